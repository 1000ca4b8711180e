package lock_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/lock"
)

// keepWork keeps lk alive with b and returns a context for the work under it, cancelled
// with the cause when the lock is lost, and when stop is called. stop returns the loss.
func keepWork(ctx context.Context, b *lock.Batcher, lk *lock.Lock) (context.Context, func() error) {
	workCtx, cancel := context.WithCancelCause(ctx)
	stopKeep := b.Keep(lk, cancel)
	return workCtx, func() error {
		err := stopKeep()
		cancel(context.Canceled)
		return err
	}
}

// TestFaultRedisRestartedMidHold: Redis without persistence is killed and restarted
// while a lock is held; the holder learns at its next refresh that the lock is gone
// (ErrLockLost itself, not the TTL deadline).
func TestFaultRedisRestartedMidHold(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	srv := testenv.StartRedis(t, testenv.PersistNone)
	rdb := testenv.RedisClient(t, srv.URL)
	locker := lock.New(rdb, nil)
	const ttl = 6 * time.Second
	const interval = ttl / 3 // Keep's

	lk, err := locker.Obtain(ctx, "restart", ttl, nil)
	if err != nil {
		t.Fatalf("Obtain: %v", err)
	}
	workCtx, stop := keepWork(ctx, lock.NewBatcher(locker), lk)
	defer stop()
	time.Sleep(2 * interval) // a refresh or two succeed

	if err := srv.Kill(); err != nil {
		t.Fatal(err)
	}
	if err := srv.Start(); err != nil {
		t.Fatal(err)
	}
	restarted := time.Now()
	select {
	case <-workCtx.Done():
	case <-time.After(ttl):
		t.Fatalf("work not cancelled %v after the restart", ttl)
	}
	t.Logf("cancelled %v after the restart", time.Since(restarted))
	if cause := context.Cause(workCtx); cause != lock.ErrLockLost {
		t.Errorf("context.Cause = %v, want ErrLockLost from a refresh", cause)
	}
	if err := lk.Release(ctx); !errors.Is(err, lock.ErrLockLost) {
		t.Errorf("Release after restart: %v, want ErrLockLost", err)
	}
	// The restarted, empty server is free for a new holder.
	if _, err := locker.Obtain(ctx, "restart", ttl, nil); err != nil {
		t.Errorf("Obtain after restart: %v", err)
	}
}

// TestFaultRedisPausedPastTTL: Redis is paused (SIGSTOP) past the lock's TTL; the
// refresh loop cancels the work by its own deadline, without waiting for Redis; stop
// does not hang; after Redis resumes, the lock is gone. The client is go-redis's
// default, which does not give up on a command at its context's deadline.
func TestFaultRedisPausedPastTTL(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	srv := testenv.StartRedis(t, testenv.PersistNone)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	t.Cleanup(func() { rdb.Close() })
	locker := lock.New(rdb, nil)
	const ttl = 900 * time.Millisecond

	lk, err := locker.Obtain(ctx, "paused", ttl, nil)
	if err != nil {
		t.Fatalf("Obtain: %v", err)
	}
	workCtx, stop := keepWork(ctx, lock.NewBatcher(locker), lk)
	defer stop()
	time.Sleep(ttl / 2)

	if err := srv.Pause(); err != nil {
		t.Fatal(err)
	}
	paused := time.Now()
	resumed := false
	defer func() {
		if !resumed {
			srv.Resume()
		}
	}()
	select {
	case <-workCtx.Done():
	case <-time.After(10 * ttl):
		t.Fatalf("work not cancelled %v after Redis was paused", 10*ttl)
	}
	took := time.Since(paused)
	t.Logf("cancelled %v after the pause", took)
	if took > ttl+ttl/2 {
		t.Errorf("cancelled %v after the pause, want by the TTL (%v) plus slack", took, ttl)
	}
	cause := context.Cause(workCtx)
	if !errors.Is(cause, lock.ErrLockLost) || cause == lock.ErrLockLost {
		t.Errorf("context.Cause = %v, want an error wrapping ErrLockLost for a TTL that ran out", cause)
	}
	start := time.Now()
	if err := stop(); !errors.Is(err, lock.ErrLockLost) {
		t.Errorf("stop() = %v, want the loss", err)
	}
	if d := time.Since(start); d > 100*time.Millisecond {
		t.Errorf("stop took %v with Redis paused, want it not to wait for Redis", d)
	}

	time.Sleep(ttl) // well past the TTL by Redis's clock too
	if err := srv.Resume(); err != nil {
		t.Fatal(err)
	}
	resumed = true
	if _, err := lk.TTL(ctx); !errors.Is(err, lock.ErrLockLost) {
		t.Errorf("TTL after resume: %v, want ErrLockLost", err)
	}
}

// TestFaultObtainWhilePaused: a client that honours context deadlines returns from
// Obtain against a paused Redis with the context's error.
func TestFaultObtainWhilePaused(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	srv := testenv.StartRedis(t, testenv.PersistNone)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr, ContextTimeoutEnabled: true})
	t.Cleanup(func() { rdb.Close() })
	locker := lock.New(rdb, nil)
	if err := rdb.Ping(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	if err := srv.Pause(); err != nil {
		t.Fatal(err)
	}
	defer srv.Resume()
	c, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := locker.Obtain(c, "k", time.Second, nil)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Obtain = %v, want a wrapped DeadlineExceeded", err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("Obtain returned after %v, want promptly after 300ms", d)
	}
}

// TestScriptsLoadedOnce: Release and Refresh use EVALSHA; the script text is sent
// (EVAL) only when the server does not know it yet, never SCRIPT LOAD per call.
func TestScriptsLoadedOnce(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	srv := testenv.StartRedis(t, testenv.PersistNone)
	rdb := testenv.RedisClient(t, srv.URL)
	locker := lock.New(rdb, nil)
	if err := rdb.ScriptFlush(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	if err := rdb.ConfigResetStat(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	const n = 50
	for range n {
		lk, err := locker.Obtain(ctx, "k", time.Second, nil)
		if err != nil {
			t.Fatal(err)
		}
		if err := lk.Refresh(ctx, time.Second); err != nil {
			t.Fatal(err)
		}
		if err := lk.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
	stats, err := rdb.InfoMap(ctx, "commandstats").Result()
	if err != nil {
		t.Fatal(err)
	}
	cs := stats["Commandstats"]
	calls := func(cmd string) string {
		return cs["cmdstat_"+cmd]
	}
	t.Logf("evalsha: %s; eval: %s; script: %s", calls("evalsha"), calls("eval"), calls("script|load"))
	evals := parseCalls(calls("eval"))
	if evals != 2 { // one per script, after the first NOSCRIPT
		t.Errorf("EVAL called %d times, want 2 (once per script)", evals)
	}
	if got := parseCalls(calls("evalsha")); got != 2*n {
		t.Errorf("EVALSHA called %d times, want %d", got, 2*n)
	}
	if got := parseCalls(calls("script|load")); got != 0 {
		t.Errorf("SCRIPT LOAD called %d times, want 0", got)
	}
}

// parseCalls reads calls=N out of an INFO commandstats value.
func parseCalls(v string) int {
	var n int
	fmt.Sscanf(v, "calls=%d", &n)
	return n
}

// TestFaultRedisOutageShorterThanTTL: with an append-only file, Redis crashes and comes
// back within the TTL; the refresh loop keeps retrying through the errors, logs them,
// and the work goes on holding the lock.
func TestFaultRedisOutageShorterThanTTL(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	srv := testenv.StartRedis(t, testenv.PersistAOFAlways)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr, MaxRetries: -1, DialTimeout: time.Second})
	t.Cleanup(func() { rdb.Close() })
	var logs testenv.LogBuffer
	locker := lock.New(rdb, &lock.Config{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	const ttl = 6 * time.Second
	const interval = ttl / 3 // Keep's; a refresh goes a quarter interval early

	lk, err := locker.Obtain(ctx, "outage", ttl, nil)
	if err != nil {
		t.Fatalf("Obtain: %v", err)
	}
	workCtx, stop := keepWork(ctx, lock.NewBatcher(locker), lk)
	defer stop()

	if err := srv.Kill(); err != nil {
		t.Fatal(err)
	}
	// A refresh comes due after 3/4 interval and fails once go-redis gives up dialling
	// (within a second), then is retried every quarter interval.
	time.Sleep(3 * interval / 2)
	if err := srv.Start(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(interval) // a retry succeeds
	if err := workCtx.Err(); err != nil {
		t.Fatalf("work cancelled during an outage shorter than the TTL: %v", context.Cause(workCtx))
	}
	d, err := lk.TTL(ctx)
	if err != nil {
		t.Fatalf("TTL after the outage: %v", err)
	}
	if d < ttl-interval {
		t.Errorf("TTL after the outage = %v, want refreshed to about %v", d, ttl)
	}
	if err := stop(); err != nil {
		t.Errorf("stop() = %v, want nil", err)
	}
	if !strings.Contains(logs.String(), "lock refresh failed") {
		t.Errorf("log = %q, want the failed refreshes logged", logs.String())
	}
	if err := lk.Release(ctx); err != nil {
		t.Errorf("Release: %v", err)
	}
}
