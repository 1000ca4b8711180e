package lock_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/lock"
)

// TestWatchKeepsAliveThenCancelsOnLoss: the watchdog keeps a lock alive across more
// than 3× its TTL; when the key is deleted behind its back, the work's context is
// cancelled within about one refresh interval, with ErrLockLost as the cause.
func TestWatchKeepsAliveThenCancelsOnLoss(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	locker, rdb := newLocker(t)
	const ttl = 900 * time.Millisecond
	const interval = ttl / 3 // the default

	lk, err := locker.Obtain(ctx, "long", ttl, nil)
	if err != nil {
		t.Fatalf("Obtain: %v", err)
	}
	var onLost atomic.Int32
	workCtx, stop := lk.Watch(ctx, &lock.WatchOptions{OnLost: func(error) { onLost.Add(1) }})
	defer stop()

	select {
	case <-workCtx.Done():
		t.Fatalf("work cancelled while the lock was held: %v", context.Cause(workCtx))
	case <-time.After(3*ttl + ttl/2):
	}
	if got := rdb.Get(ctx, locker.RedisKey("long")).Val(); got != lk.Token() {
		t.Fatalf("after 3.5×TTL GET = %q, want our token: the watchdog did not keep it alive", got)
	}
	if d, err := lk.TTL(ctx); err != nil || d <= 0 {
		t.Fatalf("TTL = %v, %v; want positive", d, err)
	}

	if err := rdb.Del(ctx, locker.RedisKey("long")).Err(); err != nil {
		t.Fatal(err)
	}
	deleted := time.Now()
	select {
	case <-workCtx.Done():
	case <-time.After(10 * ttl):
		t.Fatalf("work not cancelled %v after the key was deleted", 10*ttl)
	}
	if took := time.Since(deleted); took > 2*interval {
		t.Errorf("work cancelled %v after the key was deleted, want within 2× interval (%v)", took, 2*interval)
	}
	if cause := context.Cause(workCtx); cause != lock.ErrLockLost {
		t.Errorf("context.Cause = %v, want ErrLockLost", cause)
	}
	if err := stop(); err != lock.ErrLockLost {
		t.Errorf("stop() = %v, want ErrLockLost", err)
	}
	if got := onLost.Load(); got != 1 {
		t.Errorf("OnLost called %d times, want 1", got)
	}
}

// TestWatchIgnoreLoss: with IgnoreLoss the work goes on after a loss, and OnLost and
// stop report it.
func TestWatchIgnoreLoss(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	locker, rdb := newLocker(t)

	lk, err := locker.Obtain(ctx, "scoped", 10*time.Second, nil)
	if err != nil {
		t.Fatalf("Obtain: %v", err)
	}
	lost := make(chan error, 1)
	workCtx, stop := lk.Watch(ctx, &lock.WatchOptions{
		Interval:   50 * time.Millisecond,
		IgnoreLoss: true,
		OnLost:     func(cause error) { lost <- cause },
	})
	// Someone else takes the key over.
	if err := rdb.Set(ctx, locker.RedisKey("scoped"), "other", time.Minute).Err(); err != nil {
		t.Fatal(err)
	}
	select {
	case cause := <-lost:
		if cause != lock.ErrLockLost {
			t.Errorf("OnLost cause = %v, want ErrLockLost", cause)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("OnLost not called 5s after the key was taken over")
	}
	if err := workCtx.Err(); err != nil {
		t.Errorf("work context done (%v) despite IgnoreLoss", err)
	}
	if err := stop(); err != lock.ErrLockLost {
		t.Errorf("stop() = %v, want ErrLockLost", err)
	}
	if err := workCtx.Err(); !errors.Is(err, context.Canceled) {
		t.Errorf("after stop work context err = %v, want Canceled", err)
	}
	if err := stop(); err != lock.ErrLockLost {
		t.Errorf("second stop() = %v, want ErrLockLost", err)
	}
	if got := rdb.Get(ctx, locker.RedisKey("scoped")).Val(); got != "other" {
		t.Errorf("GET = %q, want the other holder's value left alone", got)
	}
}

// TestWatchOutlivesParentContext: cancelling the parent cancels the work context but
// the lock stays refreshed until stop.
func TestWatchOutlivesParentContext(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	locker, _ := newLocker(t)
	const ttl = 300 * time.Millisecond

	lk, err := locker.Obtain(ctx, "parent", ttl, nil)
	if err != nil {
		t.Fatalf("Obtain: %v", err)
	}
	parent, cancel := context.WithCancel(ctx)
	workCtx, stop := lk.Watch(parent, nil)
	cancel()
	<-workCtx.Done()
	time.Sleep(3 * ttl)
	if _, err := lk.TTL(ctx); err != nil {
		t.Errorf("TTL after 3×TTL with the parent cancelled: %v, want the lock still held", err)
	}
	if err := stop(); err != nil {
		t.Errorf("stop() = %v, want nil", err)
	}
	if err := lk.Release(ctx); err != nil {
		t.Errorf("Release: %v", err)
	}
}

func TestHold(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	locker, rdb := newLocker(t)
	rkey := locker.RedisKey("held")

	t.Run("releases after fn", func(t *testing.T) {
		ran := false
		err := locker.Hold(ctx, "held", 5*time.Second, nil, nil, func(ctx context.Context) error {
			ran = true
			if n := rdb.Exists(ctx, rkey).Val(); n != 1 {
				t.Errorf("key missing while fn runs")
			}
			return nil
		})
		if err != nil || !ran {
			t.Fatalf("Hold = %v, ran = %v; want nil, true", err, ran)
		}
		if n := rdb.Exists(ctx, rkey).Val(); n != 0 {
			t.Errorf("key still exists after Hold")
		}
	})

	t.Run("returns fn's error and releases", func(t *testing.T) {
		boom := errors.New("boom")
		err := locker.Hold(ctx, "held", 5*time.Second, nil, nil, func(context.Context) error { return boom })
		if err != boom {
			t.Errorf("Hold = %v, want fn's error", err)
		}
		if n := rdb.Exists(ctx, rkey).Val(); n != 0 {
			t.Errorf("key still exists after Hold")
		}
	})

	t.Run("busy", func(t *testing.T) {
		other, err := locker.Obtain(ctx, "held", 5*time.Second, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer other.Release(ctx)
		err = locker.Hold(ctx, "held", 5*time.Second, nil, nil, func(context.Context) error {
			t.Error("fn ran on a busy key")
			return nil
		})
		if !errors.Is(err, lock.ErrNotObtained) {
			t.Errorf("Hold = %v, want ErrNotObtained", err)
		}
		if got := rdb.Get(ctx, rkey).Val(); got != other.Token() {
			t.Errorf("Hold on a busy key touched it")
		}
	})

	t.Run("lost", func(t *testing.T) {
		err := locker.Hold(ctx, "held", 3*time.Second, nil, &lock.WatchOptions{Interval: 50 * time.Millisecond},
			func(ctx context.Context) error {
				rdb.Set(ctx, rkey, "thief", time.Minute)
				<-ctx.Done()
				if cause := context.Cause(ctx); cause != lock.ErrLockLost {
					t.Errorf("fn's context.Cause = %v, want ErrLockLost", cause)
				}
				return ctx.Err()
			})
		if !errors.Is(err, lock.ErrLockLost) || !errors.Is(err, context.Canceled) {
			t.Errorf("Hold = %v, want ErrLockLost joined with fn's context.Canceled", err)
		}
		if got := rdb.Get(ctx, rkey).Val(); got != "thief" {
			t.Errorf("GET = %q, want the thief's value left alone", got)
		}
		rdb.Del(ctx, rkey)
	})

	t.Run("ttl ran out without a watchdog refresh", func(t *testing.T) {
		// An interval longer than the TTL: the watchdog's own deadline fires first.
		err := locker.Hold(ctx, "expires", 100*time.Millisecond, nil, &lock.WatchOptions{Interval: time.Hour},
			func(ctx context.Context) error {
				<-ctx.Done()
				return nil
			})
		if !errors.Is(err, lock.ErrLockLost) {
			t.Errorf("Hold = %v, want ErrLockLost", err)
		}
	})

	t.Run("released lost on release", func(t *testing.T) {
		// The key vanishes between the last refresh and the release.
		err := locker.Hold(ctx, "held", 5*time.Second, nil, nil, func(ctx context.Context) error {
			rdb.Del(ctx, rkey)
			return nil
		})
		if !errors.Is(err, lock.ErrLockLost) {
			t.Errorf("Hold = %v, want ErrLockLost from Release", err)
		}
	})

	t.Run("panic in fn stops the watchdog", func(t *testing.T) {
		func() {
			defer func() {
				if recover() == nil {
					t.Error("panic was swallowed")
				}
			}()
			locker.Hold(ctx, "panicky", 5*time.Second, nil, nil, func(context.Context) error { panic("boom") })
		}()
	})
}
