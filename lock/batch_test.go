package lock_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/lock"
)

// roundTrips counts the lock commands and pipelines a client sends, and fails them while
// failing is set.
type roundTrips struct {
	singles, pipelines atomic.Int64
	failing            atomic.Bool
}

func (h *roundTrips) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *roundTrips) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if lockCommand(cmd) {
			h.singles.Add(1)
		}
		return next(ctx, cmd)
	}
}

func (h *roundTrips) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if lockCommand(cmds[0]) {
			h.pipelines.Add(1)
		}
		if h.failing.Load() {
			err := errors.New("injected: Redis unreachable")
			for _, c := range cmds {
				c.SetErr(err)
			}
			return err
		}
		return next(ctx, cmds)
	}
}

// lockCommand tells the commands of locks from those of a new connection.
func lockCommand(cmd redis.Cmder) bool {
	switch cmd.Name() {
	case "set", "evalsha", "eval":
		return true
	}
	return false
}

// newCountingLocker returns a Locker on a client of its own whose round trips h counts,
// and a plain client on the same Redis.
func newCountingLocker(t *testing.T) (*lock.Locker, *redis.Client, *roundTrips) {
	t.Helper()
	rdb := testenv.Redis(t)
	opt := *rdb.Options()
	counted := redis.NewClient(&opt)
	t.Cleanup(func() { counted.Close() })
	h := &roundTrips{}
	counted.AddHook(h)
	return lock.New(counted, nil), rdb, h
}

// TestBatcherObtainCoalesces: 64 goroutines obtain 64 keys at once; their tries share
// round trips (fewer pipelines than locks), each lock holds its own token, and a key
// asked for by 16 of them at once goes to exactly one.
func TestBatcherObtainCoalesces(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	locker, rdb, h := newCountingLocker(t)
	b := lock.NewBatcher(locker)

	const n = 64
	start := make(chan struct{})
	locks := make([]*lock.Lock, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			<-start
			lk, err := b.Obtain(ctx, fmt.Sprintf("many:%d", i), time.Minute, nil)
			if err != nil {
				t.Errorf("obtain %d: %v", i, err)
				return
			}
			locks[i] = lk
		})
	}
	close(start)
	wg.Wait()
	if t.Failed() {
		t.FailNow()
	}
	if got := h.pipelines.Load(); got >= n || h.singles.Load() != 0 {
		t.Errorf("%d pipelines and %d single commands for %d obtains, want fewer pipelines than obtains and no single command", got, h.singles.Load(), n)
	}
	t.Logf("%d obtains in %d round trips", n, h.pipelines.Load())
	for i, lk := range locks {
		if got := rdb.Get(ctx, locker.RedisKey(lk.Key())).Val(); got != lk.Token() || lk.Key() != fmt.Sprintf("many:%d", i) {
			t.Errorf("lock %d (%s): Redis holds %q, want its token %q", i, lk.Key(), got, lk.Token())
		}
		if rem := lk.Remaining(); rem <= 50*time.Second || rem > time.Minute {
			t.Errorf("lock %d: Remaining %v, want just under a minute", i, rem)
		}
	}

	var won atomic.Int32
	start = make(chan struct{})
	for range 16 {
		wg.Go(func() {
			<-start
			_, err := b.Obtain(ctx, "one", time.Minute, nil)
			switch {
			case err == nil:
				won.Add(1)
			case !errors.Is(err, lock.ErrNotObtained):
				t.Errorf("obtain: %v", err)
			}
		})
	}
	close(start)
	wg.Wait()
	if got := won.Load(); got != 1 {
		t.Errorf("%d of 16 obtained one key, want 1", got)
	}
}

// TestBatcherObtainRetriesAndMarks: a Batcher's Obtain retries as its options say, and
// marks a held key wanted.
func TestBatcherObtainRetriesAndMarks(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	locker, _ := newLocker(t)
	b := lock.NewBatcher(locker)
	held, err := b.Obtain(ctx, "r", 200*time.Millisecond, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.Obtain(ctx, "r", time.Minute, &lock.Options{Want: time.Minute}); !errors.Is(err, lock.ErrNotObtained) {
		t.Fatalf("obtain a held key: %v, want ErrNotObtained", err)
	}
	b.Wait()
	if w, err := locker.Wanted(ctx, "r"); err != nil || !w {
		t.Fatalf("Wanted after a caller found it held: %v %v, want true", w, err)
	}
	lk, err := b.Obtain(ctx, "r", time.Minute, &lock.Options{Retry: lock.LinearBackoff(50*time.Millisecond, 20)})
	if err != nil {
		t.Fatalf("obtain with retries once the holder's TTL ran out: %v", err)
	}
	if lk.Token() == held.Token() {
		t.Fatal("a new lock with the old token")
	}
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := b.Obtain(cctx, "r2", time.Minute, nil); !errors.Is(err, context.Canceled) {
		t.Fatalf("obtain with a cancelled context: %v", err)
	}
}

// TestBatcherKeepRefreshesThenReportsLoss: the refresh loop keeps 20 locks alive past 3×
// their TTL, refreshing them together; a lock deleted in Redis is reported lost (once,
// ErrLockLost) within about one interval, and the others stay held.
func TestBatcherKeepRefreshesThenReportsLoss(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	locker, rdb, h := newCountingLocker(t)
	b := lock.NewBatcher(locker)
	const ttl = 600 * time.Millisecond
	const n = 20
	locks := make([]*lock.Lock, n)
	stops := make([]func() error, n)
	var lost [n]atomic.Int32
	causes := make(chan error, n)
	for i := range n {
		lk, err := b.Obtain(ctx, fmt.Sprintf("kept:%d", i), ttl, nil)
		if err != nil {
			t.Fatal(err)
		}
		locks[i] = lk
		stops[i] = b.Keep(lk, func(cause error) {
			lost[i].Add(1)
			causes <- cause
		})
	}
	before := h.pipelines.Load()
	time.Sleep(3*ttl + ttl/2)
	for i, lk := range locks {
		if got := rdb.Get(ctx, locker.RedisKey(lk.Key())).Val(); got != lk.Token() {
			t.Fatalf("lock %d after 3.5×TTL: Redis holds %q, want its token", i, got)
		}
	}
	// 20 locks refreshed about 10 times each: far fewer pipelines than refreshes.
	if got := h.pipelines.Load() - before; got >= n*10/2 {
		t.Errorf("%d pipelines to refresh %d locks for 3.5×TTL, want them refreshed together", got, n)
	}
	t.Logf("%d refresh round trips for %d locks over %v", h.pipelines.Load()-before, n, 3*ttl+ttl/2)

	if err := rdb.Del(ctx, locker.RedisKey("kept:3")).Err(); err != nil {
		t.Fatal(err)
	}
	deleted := time.Now()
	select {
	case cause := <-causes:
		if cause != lock.ErrLockLost {
			t.Errorf("cause %v, want ErrLockLost", cause)
		}
		if took := time.Since(deleted); took > 2*ttl/3 {
			t.Errorf("loss reported %v after the delete, want within 2 intervals (%v)", took, 2*ttl/3)
		}
	case <-time.After(5 * ttl):
		t.Fatal("the deleted lock was never reported lost")
	}
	time.Sleep(ttl)
	for i := range n {
		want := int32(0)
		if i == 3 {
			want = 1
		}
		if got := lost[i].Load(); got != want {
			t.Errorf("lock %d reported lost %d times, want %d", i, got, want)
		}
	}
	if err := stops[3](); err != lock.ErrLockLost {
		t.Errorf("stop of the lost lock = %v, want ErrLockLost", err)
	}
	for i, stop := range stops {
		if i != 3 {
			if err := stop(); err != nil {
				t.Errorf("stop %d = %v, want nil", i, err)
			}
		}
	}
}

// TestBatcherKeepLosesWhenRedisFails: while Redis cannot be reached, the loop retries,
// and reports the lock lost once its TTL has run out by our own clock, with an error
// wrapping ErrLockLost and the Redis error.
func TestBatcherKeepLosesWhenRedisFails(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	locker, _, h := newCountingLocker(t)
	b := lock.NewBatcher(locker)
	const ttl = 300 * time.Millisecond
	lk, err := b.Obtain(ctx, "failing", ttl, nil)
	if err != nil {
		t.Fatal(err)
	}
	causes := make(chan error, 1)
	h.failing.Store(true)
	stop := b.Keep(lk, func(cause error) { causes <- cause })
	defer stop()
	select {
	case cause := <-causes:
		if !errors.Is(cause, lock.ErrLockLost) || cause == lock.ErrLockLost || !containsInjected(cause) {
			t.Errorf("cause %v, want ErrLockLost wrapped with the Redis error", cause)
		}
		if rem := lk.Remaining(); rem > 0 {
			t.Errorf("reported lost with %v of TTL left by our clock", rem)
		}
	case <-time.After(3 * ttl):
		t.Fatal("never reported lost")
	}
}

func containsInjected(err error) bool {
	for e := err; e != nil; {
		if u, ok := e.(interface{ Unwrap() []error }); ok {
			for _, x := range u.Unwrap() {
				if containsInjected(x) {
					return true
				}
			}
			return false
		}
		if e.Error() == "injected: Redis unreachable" {
			return true
		}
		e = errors.Unwrap(e)
	}
	return false
}

// TestBatcherKeepTakenOver: a lock that another holder took over is reported lost with
// ErrLockLost, to onLost when it is set, and by every call of stop either way; the other
// holder's key is left alone.
func TestBatcherKeepTakenOver(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	locker, rdb := newLocker(t)
	b := lock.NewBatcher(locker)
	const ttl = 300 * time.Millisecond
	keys := []string{"taken:reported", "taken:silent"}
	stops := make([]func() error, len(keys))
	lost := make(chan error, 1)
	for i, key := range keys {
		lk, err := b.Obtain(ctx, key, ttl, nil)
		if err != nil {
			t.Fatal(err)
		}
		var onLost func(error)
		if i == 0 {
			onLost = func(cause error) { lost <- cause }
		}
		stops[i] = b.Keep(lk, onLost)
	}
	for _, key := range keys {
		if err := rdb.Set(ctx, locker.RedisKey(key), "other", time.Minute).Err(); err != nil {
			t.Fatal(err)
		}
	}
	select {
	case cause := <-lost:
		if cause != lock.ErrLockLost {
			t.Errorf("onLost cause = %v, want ErrLockLost", cause)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("loss not reported 20s after the key was taken over")
	}
	time.Sleep(3 * ttl) // the silent lock is found lost by the same refresh, or the next
	for i, key := range keys {
		for call := 1; call <= 2; call++ {
			if err := stops[i](); err != lock.ErrLockLost {
				t.Errorf("%s: stop() call %d = %v, want ErrLockLost", key, call, err)
			}
		}
		if got := rdb.Get(ctx, locker.RedisKey(key)).Val(); got != "other" {
			t.Errorf("%s: GET = %q, want the other holder's value left alone", key, got)
		}
	}
}

// TestBatcherKeepUntilStop: a lock is refreshed until stop and no longer: it then
// expires in Redis, its loss is never reported, and a lock kept beside it goes on being
// refreshed.
func TestBatcherKeepUntilStop(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	locker, rdb := newLocker(t)
	b := lock.NewBatcher(locker)
	const ttl = 300 * time.Millisecond
	stopped, err := b.Obtain(ctx, "until-stop", ttl, nil)
	if err != nil {
		t.Fatal(err)
	}
	beside, err := b.Obtain(ctx, "beside", ttl, nil)
	if err != nil {
		t.Fatal(err)
	}
	onLost := func(cause error) { t.Errorf("loss reported: %v", cause) }
	stop := b.Keep(stopped, onLost)
	stopBeside := b.Keep(beside, onLost)

	time.Sleep(3*ttl + ttl/2)
	if got := rdb.Get(ctx, locker.RedisKey("until-stop")).Val(); got != stopped.Token() {
		t.Fatalf("after 3.5×TTL GET = %q, want our token", got)
	}
	if err := stop(); err != nil {
		t.Errorf("stop() = %v, want nil", err)
	}
	time.Sleep(ttl + ttl/2) // past the TTL of its last refresh
	if n := rdb.Exists(ctx, locker.RedisKey("until-stop")).Val(); n != 0 {
		t.Errorf("the lock still exists 1.5×TTL after stop: still refreshed")
	}
	if got := rdb.Get(ctx, locker.RedisKey("beside")).Val(); got != beside.Token() {
		t.Errorf("the lock kept beside: GET = %q, want its token", got)
	}
	if err := stopBeside(); err != nil {
		t.Errorf("stop of the lock kept beside = %v, want nil", err)
	}
	if err := stop(); err != nil {
		t.Errorf("second stop() = %v, want nil", err)
	}
}

// TestBatcherReleasesOwnTokensOnly: releases queued together delete the locks that still
// hold our tokens and leave another holder's in place (ErrLockLost); Wait returns once
// they are answered.
func TestBatcherReleasesOwnTokensOnly(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	locker, rdb, h := newCountingLocker(t)
	b := lock.NewBatcher(locker)
	const n = 20
	var locks []*lock.Lock
	for i := range n {
		lk, err := b.Obtain(ctx, fmt.Sprintf("rel:%d", i), time.Minute, nil)
		if err != nil {
			t.Fatal(err)
		}
		locks = append(locks, lk)
	}
	// Every other lock is someone else's now (ours expired, they took it).
	for i := 0; i < n; i += 2 {
		if err := rdb.Set(ctx, locker.RedisKey(locks[i].Key()), "theirs", time.Minute).Err(); err != nil {
			t.Fatal(err)
		}
	}
	before := h.pipelines.Load()
	outcomes := make([]error, n)
	var answered atomic.Int32
	for i, lk := range locks {
		b.Release(lk, func(err error) {
			outcomes[i] = err
			answered.Add(1)
		})
	}
	b.Wait()
	if got := answered.Load(); got != n {
		t.Fatalf("Wait returned with %d of %d releases answered", got, n)
	}
	if got := h.pipelines.Load() - before; got >= n {
		t.Errorf("%d pipelines for %d releases, want fewer", got, n)
	}
	for i, lk := range locks {
		val, err := rdb.Get(ctx, locker.RedisKey(lk.Key())).Result()
		if i%2 == 0 {
			if val != "theirs" || outcomes[i] != lock.ErrLockLost {
				t.Errorf("lock %d held by another: value %q (%v), release %v; want theirs kept and ErrLockLost", i, val, err, outcomes[i])
			}
			continue
		}
		if !errors.Is(err, redis.Nil) || outcomes[i] != nil {
			t.Errorf("lock %d: value %q (%v), release %v; want deleted and nil", i, val, err, outcomes[i])
		}
	}
}

// TestBatcherScriptsAfterFlush: calls whose script Redis no longer knows (a restart, a
// SCRIPT FLUSH) are sent again with the script's text.
func TestBatcherScriptsAfterFlush(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	srv := testenv.StartRedis(t, testenv.PersistNone)
	rdb := testenv.RedisClient(t, srv.URL)
	locker := lock.New(rdb, nil)
	b := lock.NewBatcher(locker)
	var locks []*lock.Lock
	for i := range 10 {
		lk, err := b.Obtain(ctx, fmt.Sprintf("f:%d", i), time.Minute, nil)
		if err != nil {
			t.Fatal(err)
		}
		locks = append(locks, lk)
	}
	if err := rdb.ScriptFlush(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	for _, lk := range locks {
		b.Release(lk, func(err error) {
			if err != nil {
				t.Errorf("release: %v", err)
			}
		})
	}
	b.Wait()
	if n := rdb.Exists(ctx, locker.RedisKey("f:0"), locker.RedisKey("f:9")).Val(); n != 0 {
		t.Errorf("%d locks left after their release", n)
	}
}

// TestBatcherDoWaitsForItsCalls: 32 goroutines each release a lock with Do at once; each
// returns with its release answered, and they share round trips.
func TestBatcherDoWaitsForItsCalls(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	locker, rdb, h := newCountingLocker(t)
	b := lock.NewBatcher(locker)
	const n = 32
	locks := make([]*lock.Lock, n)
	for i := range n {
		lk, err := b.Obtain(ctx, fmt.Sprintf("do:%d", i), time.Minute, nil)
		if err != nil {
			t.Fatal(err)
		}
		locks[i] = lk
	}
	before := h.pipelines.Load()
	start := make(chan struct{})
	var wg sync.WaitGroup
	for _, lk := range locks {
		wg.Go(func() {
			<-start
			var got error = errors.New("not answered")
			b.Do(ctx, lk.ReleaseCall(func(err error) { got = err }))
			if got != nil {
				t.Errorf("%s: Do returned with its release %v", lk.Key(), got)
			}
			if n := rdb.Exists(ctx, locker.RedisKey(lk.Key())).Val(); n != 0 {
				t.Errorf("%s still in Redis after Do", lk.Key())
			}
		})
	}
	close(start)
	wg.Wait()
	if got := h.pipelines.Load() - before; got >= n {
		t.Errorf("%d pipelines for %d calls, want fewer", got, n)
	}
	b.Wait()
}

// TestBatcherWakesWhoWaited: two Batchers as two processes. The holder hears that the
// other waits for its lock (Wanted), and its release wakes the other (Freed); a lock
// nobody waits for is not reported wanted.
func TestBatcherWakesWhoWaited(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	locker, _ := newLocker(t)
	holder, waiter := lock.NewBatcher(locker), lock.NewBatcher(locker)
	defer holder.Close()
	defer waiter.Close()
	want := &lock.Options{Want: time.Second}

	lk, err := holder.Obtain(ctx, "hot", time.Minute, want)
	if err != nil {
		t.Fatal(err)
	}
	quiet, err := holder.Obtain(ctx, "quiet", time.Minute, want)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := waiter.Obtain(ctx, "hot", time.Minute, want); !errors.Is(err, lock.ErrNotObtained) {
		t.Fatalf("obtain a held key: %v, want ErrNotObtained", err)
	}
	freed, done := waiter.Freed("hot")
	defer done()
	// The waiter repeats its ask, as a waiting caller does, until the holder hears it.
	deadline := time.Now().Add(20 * time.Second)
	for !holder.Wanted(lk) {
		if time.Now().After(deadline) {
			t.Fatal("the holder never heard that the other Batcher waits")
		}
		time.Sleep(20 * time.Millisecond)
		waiter.Obtain(ctx, "hot", time.Minute, want)
	}
	if holder.Wanted(quiet) {
		t.Fatal("a lock nobody asked for is reported wanted")
	}
	select {
	case <-freed:
		t.Fatal("freed before the release")
	default:
	}
	holder.Release(lk, nil)
	holder.Wake(lk)
	select {
	case <-freed:
	case <-time.After(20 * time.Second):
		t.Fatal("the release did not wake the waiting Batcher")
	}
	if _, err := waiter.Obtain(ctx, "hot", time.Minute, want); err != nil {
		t.Fatalf("obtain once woken: %v", err)
	}
}
