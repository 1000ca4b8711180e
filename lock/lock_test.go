package lock_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/lock"
)

func newLocker(t *testing.T) (*lock.Locker, *redis.Client) {
	t.Helper()
	rdb := testenv.Redis(t)
	return lock.New(rdb, nil), rdb
}

func TestObtainRefreshTTLRelease(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	locker, rdb := newLocker(t)

	lk, err := locker.Obtain(ctx, "job:1", 10*time.Second, nil)
	if err != nil {
		t.Fatalf("Obtain: %v", err)
	}
	if got, want := lk.Key(), "job:1"; got != want {
		t.Errorf("Key() = %q, want %q", got, want)
	}
	if len(lk.Token()) < 22 {
		t.Errorf("Token() = %q, want at least 128 random bits", lk.Token())
	}
	rkey := locker.RedisKey("job:1")
	if got, want := rkey, "idemq:lock:job:1"; got != want {
		t.Errorf("RedisKey = %q, want %q", got, want)
	}
	if got, err := rdb.Get(ctx, rkey).Result(); err != nil || got != lk.Token() {
		t.Fatalf("GET %s = %q, %v; want the token %q", rkey, got, err, lk.Token())
	}
	if pttl := rdb.PTTL(ctx, rkey).Val(); pttl <= 9*time.Second || pttl > 10*time.Second {
		t.Errorf("PTTL = %v, want about 10s", pttl)
	}

	if _, err := locker.Obtain(ctx, "job:1", time.Second, nil); !errors.Is(err, lock.ErrNotObtained) {
		t.Fatalf("second Obtain: err = %v, want ErrNotObtained", err)
	}

	if err := lk.Refresh(ctx, time.Minute); err != nil {
		t.Fatalf("Refresh: %v", err)
	}
	ttl, err := lk.TTL(ctx)
	if err != nil {
		t.Fatalf("TTL: %v", err)
	}
	if ttl <= 50*time.Second || ttl > time.Minute {
		t.Errorf("TTL after Refresh(1m) = %v, want about 1m", ttl)
	}

	if err := lk.Release(ctx); err != nil {
		t.Fatalf("Release: %v", err)
	}
	if n := rdb.Exists(ctx, rkey).Val(); n != 0 {
		t.Fatalf("key still exists after Release")
	}
	if err := lk.Release(ctx); !errors.Is(err, lock.ErrLockLost) {
		t.Errorf("second Release: err = %v, want ErrLockLost", err)
	}
	if err := lk.Refresh(ctx, time.Second); !errors.Is(err, lock.ErrLockLost) {
		t.Errorf("Refresh after Release: err = %v, want ErrLockLost", err)
	}
	if _, err := lk.TTL(ctx); !errors.Is(err, lock.ErrLockLost) {
		t.Errorf("TTL after Release: err = %v, want ErrLockLost", err)
	}
	if n := rdb.Exists(ctx, rkey).Val(); n != 0 {
		t.Fatalf("Refresh after Release resurrected the key")
	}

	// Free again: a new holder gets a new token.
	lk2, err := locker.Obtain(ctx, "job:1", time.Second, nil)
	if err != nil {
		t.Fatalf("Obtain after Release: %v", err)
	}
	if lk2.Token() == lk.Token() {
		t.Errorf("two obtains got the same token %q", lk.Token())
	}
}

func TestPrefixAndValidation(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	rdb := testenv.Redis(t)
	locker := lock.New(rdb, &lock.Config{Prefix: "custom:"})

	lk, err := locker.Obtain(ctx, "k", time.Second, nil)
	if err != nil {
		t.Fatalf("Obtain: %v", err)
	}
	if got := rdb.Get(ctx, "custom:k").Val(); got != lk.Token() {
		t.Errorf("GET custom:k = %q, want the token", got)
	}
	if n := rdb.Exists(ctx, "idemq:lock:k").Val(); n != 0 {
		t.Errorf("default-prefixed key exists with a custom prefix")
	}
	// A tiny TTL is sent with millisecond precision.
	short, err := locker.Obtain(ctx, "short", 1500*time.Millisecond, nil)
	if err != nil {
		t.Fatalf("Obtain 1.5s: %v", err)
	}
	if pttl := rdb.PTTL(ctx, "custom:short").Val(); pttl <= time.Second || pttl > 1500*time.Millisecond {
		t.Errorf("PTTL = %v, want about 1.5s", pttl)
	}
	_ = short

	for _, tc := range []struct {
		name string
		key  string
		ttl  time.Duration
	}{
		{"empty key", "", time.Second},
		{"zero ttl", "x", 0},
		{"sub-millisecond ttl", "x", time.Microsecond},
		{"negative ttl", "x", -time.Second},
	} {
		if _, err := locker.Obtain(ctx, tc.key, tc.ttl, nil); err == nil || errors.Is(err, lock.ErrNotObtained) {
			t.Errorf("%s: Obtain err = %v, want a validation error", tc.name, err)
		}
	}
	if err := lk.Refresh(ctx, 0); err == nil || errors.Is(err, lock.ErrLockLost) {
		t.Errorf("Refresh(0): err = %v, want a validation error", err)
	}
	if got := rdb.Get(ctx, "custom:k").Val(); got != lk.Token() {
		t.Errorf("invalid Refresh touched the key")
	}
}

// TestContention: 100 goroutines contend for one key. At no instant do two of them
// hold it, and with retries every one of them eventually gets it.
func TestContention(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, 2*time.Minute)
	locker, _ := newLocker(t)

	const n = 100
	var inside, maxInside, obtained atomic.Int32
	opts := &lock.Options{Retry: lock.ExponentialBackoff(time.Millisecond, 20*time.Millisecond, 100000)}
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for range n {
		wg.Go(func() {
			lk, err := locker.Obtain(ctx, "contended", 10*time.Second, opts)
			if err != nil {
				errs <- err
				return
			}
			obtained.Add(1)
			cur := inside.Add(1)
			for {
				m := maxInside.Load()
				if cur <= m || maxInside.CompareAndSwap(m, cur) {
					break
				}
			}
			time.Sleep(time.Millisecond)
			inside.Add(-1)
			if err := lk.Release(ctx); err != nil {
				errs <- err
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Errorf("goroutine: %v", err)
	}
	if got := maxInside.Load(); got != 1 {
		t.Errorf("at most %d goroutines held the lock at once, want 1", got)
	}
	if got := obtained.Load(); got != n {
		t.Errorf("%d of %d goroutines obtained the lock", got, n)
	}
}

// TestExpiredLockTakenOver: a lock that expired can be obtained by another; the first
// holder's Release and Refresh then fail with ErrLockLost and leave the new holder's
// lock in place.
func TestExpiredLockTakenOver(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	locker, rdb := newLocker(t)
	rkey := locker.RedisKey("expiring")

	first, err := locker.Obtain(ctx, "expiring", 50*time.Millisecond, nil)
	if err != nil {
		t.Fatalf("first Obtain: %v", err)
	}
	second, err := locker.Obtain(ctx, "expiring", 30*time.Second,
		&lock.Options{Retry: lock.LinearBackoff(10*time.Millisecond, 500)})
	if err != nil {
		t.Fatalf("second Obtain after expiry: %v", err)
	}

	check := func(when string) {
		t.Helper()
		if got := rdb.Get(ctx, rkey).Val(); got != second.Token() {
			t.Errorf("%s: GET = %q, want the second holder's token %q", when, got, second.Token())
		}
		if pttl := rdb.PTTL(ctx, rkey).Val(); pttl <= 25*time.Second || pttl > 30*time.Second {
			t.Errorf("%s: PTTL = %v, want the second holder's ~30s", when, pttl)
		}
	}
	if err := first.Refresh(ctx, time.Hour); !errors.Is(err, lock.ErrLockLost) {
		t.Errorf("first Refresh: err = %v, want ErrLockLost", err)
	}
	check("after the first holder's Refresh")
	if err := first.Release(ctx); !errors.Is(err, lock.ErrLockLost) {
		t.Errorf("first Release: err = %v, want ErrLockLost", err)
	}
	check("after the first holder's Release")
	if _, err := first.TTL(ctx); !errors.Is(err, lock.ErrLockLost) {
		t.Errorf("first TTL: err = %v, want ErrLockLost", err)
	}
	if err := second.Release(ctx); err != nil {
		t.Errorf("second Release: %v", err)
	}
}

// TestObtainContext: Obtain with a cancelled or expiring context returns promptly with
// a wrapped context error.
func TestObtainContext(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	locker, _ := newLocker(t)
	if _, err := locker.Obtain(ctx, "busy", time.Minute, nil); err != nil {
		t.Fatalf("Obtain: %v", err)
	}

	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := locker.Obtain(cancelled, "free", time.Minute, nil); !errors.Is(err, context.Canceled) {
		t.Errorf("Obtain with a cancelled context: err = %v, want context.Canceled", err)
	}

	tests := []struct {
		name  string
		retry lock.RetryStrategy
		ctx   func() (context.Context, context.CancelFunc)
		want  error
	}{
		{"deadline during linear retries", lock.LinearBackoff(20*time.Millisecond, 1000000),
			func() (context.Context, context.CancelFunc) { return context.WithTimeout(ctx, 200*time.Millisecond) },
			context.DeadlineExceeded},
		{"deadline during a long backoff", lock.LinearBackoff(time.Hour, 1),
			func() (context.Context, context.CancelFunc) { return context.WithTimeout(ctx, 200*time.Millisecond) },
			context.DeadlineExceeded},
		{"cancel during a long backoff", lock.ExponentialBackoff(time.Hour, time.Hour, 3),
			func() (context.Context, context.CancelFunc) {
				c, cancel := context.WithCancel(ctx)
				time.AfterFunc(200*time.Millisecond, cancel)
				return c, cancel
			},
			context.Canceled},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c, cancel := tc.ctx()
			defer cancel()
			start := time.Now()
			_, err := locker.Obtain(c, "busy", time.Minute, &lock.Options{Retry: tc.retry})
			elapsed := time.Since(start)
			if !errors.Is(err, tc.want) {
				t.Errorf("err = %v, want %v", err, tc.want)
			}
			if !strings.Contains(err.Error(), `"busy"`) {
				t.Errorf("err = %v, want it to name the key", err)
			}
			if elapsed > 3*time.Second {
				t.Errorf("Obtain returned %v after start, want promptly after 200ms", elapsed)
			}
		})
	}
}

// TestRedisErrors: errors from an unreachable Redis come back wrapped, never as
// ErrNotObtained or ErrLockLost.
func TestRedisErrors(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	srv := testenv.StartRedis(t, testenv.PersistNone)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr, MaxRetries: -1, DialTimeout: time.Second})
	t.Cleanup(func() { rdb.Close() })
	locker := lock.New(rdb, nil)
	lk, err := locker.Obtain(ctx, "k", time.Minute, nil)
	if err != nil {
		t.Fatalf("Obtain: %v", err)
	}
	if err := srv.Kill(); err != nil {
		t.Fatal(err)
	}
	isRedisErr := func(op string, err error) {
		t.Helper()
		if err == nil || errors.Is(err, lock.ErrNotObtained) || errors.Is(err, lock.ErrLockLost) {
			t.Errorf("%s: err = %v, want a Redis error", op, err)
		}
		if err != nil && !strings.HasPrefix(err.Error(), "lock: "+op) {
			t.Errorf("%s: err = %q, want it to start with %q", op, err, "lock: "+op)
		}
	}
	_, err = locker.Obtain(ctx, "k2", time.Minute, nil)
	isRedisErr("obtain", err)
	isRedisErr("refresh", lk.Refresh(ctx, time.Minute))
	isRedisErr("release", lk.Release(ctx))
	_, err = lk.TTL(ctx)
	isRedisErr("ttl", err)
	_, err = lock.NewBatcher(locker).Obtain(ctx, "k3", time.Minute, nil)
	isRedisErr("obtain", err)
}

// A caller that finds the key held marks it wanted (Options.Want); the holder learns it
// once (Wanted clears the mark), and the mark expires on its own.
func TestWantedMark(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	locker, _ := newLocker(t)
	held, err := locker.Obtain(ctx, "w", time.Minute, nil)
	if err != nil {
		t.Fatal(err)
	}
	if w, err := locker.Wanted(ctx, "w"); err != nil || w {
		t.Fatalf("Wanted before anyone asked: %v %v, want false", w, err)
	}
	if _, err := locker.Obtain(ctx, "w", time.Minute, &lock.Options{Want: 100 * time.Millisecond}); !errors.Is(err, lock.ErrNotObtained) {
		t.Fatalf("obtain a held key: %v", err)
	}
	if w, err := locker.Wanted(ctx, "w"); err != nil || !w {
		t.Fatalf("Wanted after a caller found it held: %v %v, want true", w, err)
	}
	if w, _ := locker.Wanted(ctx, "w"); w {
		t.Fatal("Wanted twice for one ask: the mark must be cleared")
	}
	locker.Obtain(ctx, "w", time.Minute, &lock.Options{Want: 50 * time.Millisecond})
	time.Sleep(150 * time.Millisecond)
	if w, _ := locker.Wanted(ctx, "w"); w {
		t.Fatal("the mark outlived its TTL")
	}
	if rem := held.Remaining(); rem < 50*time.Second || rem > time.Minute {
		t.Fatalf("Remaining %s, want just under the minute obtained", rem)
	}
}
