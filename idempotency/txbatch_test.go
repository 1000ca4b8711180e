package idempotency

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/internal/testenv"
)

// Shared helpers, under the names these tests use.
var (
	batchExec  = testenv.Exec
	batchCount = testenv.Count
)

func batchReq(key string) Request {
	return Request{Key: key, TaskType: "test:task", Fingerprint: Fingerprint("test:task", []byte(key))}
}

// queued reports how many members wait in l's queue.
func queued(l *Ledger) int { return l.tx.Queued() }

// waitQueued waits until n members wait in l's queue.
func waitQueued(t *testing.T, l *Ledger, n int) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for queued(l) < n {
		if time.Now().After(deadline) {
			t.Fatalf("%d members queued, want %d", queued(l), n)
		}
		time.Sleep(time.Millisecond)
	}
}

// eventCounts counts the ledger's events (Config.Observe) of the kinds asked for with of.
// Ask before the ledger runs.
type eventCounts struct{ n map[Event]*atomic.Int64 }

// of returns the counter of ev.
func (c *eventCounts) of(ev Event) *atomic.Int64 {
	if c.n == nil {
		c.n = map[Event]*atomic.Int64{}
	}
	if c.n[ev] == nil {
		c.n[ev] = &atomic.Int64{}
	}
	return c.n[ev]
}

func (c *eventCounts) observe(ev Event, _ string) {
	if n := c.n[ev]; n != nil {
		n.Add(1)
	}
}

// holdExecutor runs a DoTx whose fn blocks until release is closed, so that with one
// committer the deliveries made meanwhile queue up and then share one transaction.
func holdExecutor(t *testing.T, l *Ledger, key string) (release func(), wait func()) {
	t.Helper()
	entered, gate := make(chan struct{}), make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		_, err := l.DoTx(context.Background(), batchReq(key), func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
			close(entered)
			<-gate
			return nil, nil
		})
		if err != nil {
			t.Errorf("holder: %v", err)
		}
	})
	<-entered
	return func() { close(gate) }, wg.Wait
}

// TestDoTxBatchedManyKeys: many concurrent deliveries of distinct keys each take effect
// once, and shared transactions really carry more than one.
func TestDoTxBatchedManyKeys(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, 2*time.Minute)
	pool := testenv.Postgres(t)
	var mu sync.Mutex
	events := map[Event]int{}
	var batches, shared int
	l := New(pool, &Config{
		Observe: func(ev Event, _ string) { mu.Lock(); events[ev]++; mu.Unlock() },
		ObserveBatch: func(kind string, size int) {
			mu.Lock()
			defer mu.Unlock()
			if kind == BatchTx {
				batches++
				if size > 1 {
					shared += size
				}
			}
		},
	})
	l.tx.Budget, l.tx.Slow = time.Hour, time.Hour // shared, however slow the race detector makes the handlers
	defer l.Close()
	batchExec(t, pool, `CREATE TABLE effects (key text NOT NULL)`)

	const workers, perWorker = 32, 20
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for i := range perWorker {
				key := fmt.Sprintf("k-%d-%d", w, i)
				res, err := l.DoTx(ctx, batchReq(key), func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
					if k, _, ok := FromContext(ctx); !ok || k != key {
						return nil, fmt.Errorf("FromContext = %q, %t", k, ok)
					}
					_, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1)`, key)
					return json.RawMessage(`{"key":"` + key + `"}`), err
				})
				if err != nil {
					t.Errorf("%s: %v", key, err)
					return
				}
				if res.Cached || res.Key != key || string(res.Result) != `{"key":"`+key+`"}` || res.Fence == 0 {
					t.Errorf("%s: result %+v", key, res)
				}
			}
		})
	}
	wg.Wait()
	const n = workers * perWorker
	if got := batchCount(t, pool, `SELECT count(DISTINCT key) FROM effects`); got != n {
		t.Fatalf("distinct effects = %d, want %d", got, n)
	}
	if got := batchCount(t, pool, `SELECT count(*) FROM effects`); got != n {
		t.Fatalf("effects = %d, want %d", got, n)
	}
	if got := batchCount(t, pool, `SELECT count(*) FROM processed_jobs WHERE status = 'completed' AND result IS NOT NULL`); got != n {
		t.Fatalf("completed rows = %d, want %d", got, n)
	}
	mu.Lock()
	defer mu.Unlock()
	if claimed, completed := events[EventClaimed], events[EventCompleted]; claimed != n || completed != n {
		t.Fatalf("claimed %d, completed %d events, want %d", claimed, completed, n)
	}
	t.Logf("%d deliveries in %d transactions; %d shared one", n, batches, shared)
	if shared == 0 {
		t.Fatal("no transaction carried more than one delivery")
	}
}

// TestDoTxFailingMembers: in one shared transaction, members that fail in every way
// leave no trace and cost nobody else; the same members without shared commits behave
// the same.
func TestDoTxFailingMembers(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"own-tx", "savepoints", "optimistic"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			testFailingMembers(t, mode)
		})
	}
}

// testFailingMembers runs the members in transactions of their own (own-tx), or in one
// shared transaction: with a savepoint each (savepoints), where every failure is its
// member's alone; or without (optimistic), where the first failure rolls the transaction
// back and every member runs alone. Either way each member's outcome is its outcome alone.
func testFailingMembers(t *testing.T, mode string) {
	ctx := testenv.Context(t, 2*time.Minute)
	pool := testenv.Postgres(t)
	shared := mode != "own-tx"
	var reruns atomic.Int64
	l := New(pool, &Config{Committers: 1, DisableGroupCommit: !shared, Observe: func(ev Event, _ string) {
		if ev == EventSharedRerun {
			reruns.Add(1)
		}
	}})
	l.tx.Budget, l.tx.Slow = time.Hour, time.Hour // every member in the one transaction, however slow the race detector makes it
	if mode == "savepoints" {
		l.tx.SavepointsUntil(time.Unix(0, math.MaxInt64))
	}
	defer l.Close()
	batchExec(t, pool, `CREATE TABLE effects (key text NOT NULL)`)

	type outcome struct {
		res      Result
		err      error
		panicked any
		xid      string
	}
	effect := func(ctx context.Context, tx pgx.Tx, key string) (string, error) {
		var xid string
		_, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1)`, key)
		if err == nil {
			err = tx.QueryRow(ctx, `SELECT pg_current_xact_id()::text`).Scan(&xid)
		}
		return xid, err
	}
	members := map[string]func(ctx context.Context, tx pgx.Tx, o *outcome) (json.RawMessage, error){
		"a-ok": func(ctx context.Context, tx pgx.Tx, o *outcome) (json.RawMessage, error) {
			var err error
			o.xid, err = effect(ctx, tx, "a-ok")
			return json.RawMessage(`"a"`), err
		},
		"b-error": func(ctx context.Context, tx pgx.Tx, o *outcome) (json.RawMessage, error) {
			effect(ctx, tx, "b-error")
			return nil, errors.New("boom")
		},
		"c-panic": func(ctx context.Context, tx pgx.Tx, o *outcome) (json.RawMessage, error) {
			effect(ctx, tx, "c-panic")
			panic("oops")
		},
		"d-sql-error": func(ctx context.Context, tx pgx.Tx, o *outcome) (json.RawMessage, error) {
			effect(ctx, tx, "d-sql-error")
			_, err := tx.Exec(ctx, `SELECT 1/0`)
			return nil, err
		},
		"e-swallowed-sql-error": func(ctx context.Context, tx pgx.Tx, o *outcome) (json.RawMessage, error) {
			effect(ctx, tx, "e-swallowed-sql-error")
			tx.Exec(ctx, `SELECT no_such_column FROM effects`)
			return json.RawMessage(`1`), nil
		},
		"f-ok-nested": func(ctx context.Context, tx pgx.Tx, o *outcome) (json.RawMessage, error) {
			// A savepoint of the handler's own rolls back inside the member's.
			pgx.BeginFunc(ctx, tx, func(sp pgx.Tx) error {
				sp.Exec(ctx, `INSERT INTO effects VALUES ('dropped')`)
				return errors.New("undo this part")
			})
			var err error
			o.xid, err = effect(ctx, tx, "f-ok-nested")
			return nil, err
		},
		"g-refused-result": func(ctx context.Context, tx pgx.Tx, o *outcome) (json.RawMessage, error) {
			effect(ctx, tx, "g-refused-result")
			return json.RawMessage(`1e1000000`), nil // valid JSON that jsonb refuses
		},
		"i-marker": func(ctx context.Context, tx pgx.Tx, o *outcome) (json.RawMessage, error) {
			var err error
			o.xid, err = effect(ctx, tx, "i-marker")
			return json.RawMessage(`{not json`), err
		},
		"j-ok": func(ctx context.Context, tx pgx.Tx, o *outcome) (json.RawMessage, error) {
			var err error
			o.xid, err = effect(ctx, tx, "j-ok")
			return json.RawMessage(`"j"`), err
		},
	}
	release, waitHolder := holdExecutor(t, l, "0-holder")
	if !shared {
		release()
	}
	outcomes := map[string]*outcome{}
	var wg sync.WaitGroup
	for key, fn := range members {
		o := &outcome{}
		outcomes[key] = o
		wg.Go(func() {
			defer func() { o.panicked = recover() }()
			o.res, o.err = l.DoTx(ctx, batchReq(key), func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
				return fn(ctx, tx, o)
			})
		})
	}
	if shared {
		waitQueued(t, l, len(members))
		release()
	}
	wg.Wait()
	waitHolder()

	for _, key := range []string{"a-ok", "f-ok-nested", "i-marker", "j-ok"} {
		o := outcomes[key]
		if o.err != nil || o.panicked != nil || o.res.Cached || o.res.Key != key {
			t.Errorf("%s: %+v, want success", key, o)
		}
		if n := batchCount(t, pool, `SELECT count(*) FROM effects WHERE key = $1`, key); n != 1 {
			t.Errorf("%s: %d effects, want 1", key, n)
		}
		if n := batchCount(t, pool, `SELECT count(*) FROM processed_jobs WHERE idempotency_key = $1 AND status = 'completed' AND fence = $2`, key, o.res.Fence); n != 1 {
			t.Errorf("%s: no completed row with fence %d", key, o.res.Fence)
		}
		if mode == "savepoints" && o.xid != outcomes["a-ok"].xid {
			t.Errorf("%s ran in transaction %s, a-ok in %s: want one shared transaction", key, o.xid, outcomes["a-ok"].xid)
		}
		if mode == "optimistic" && key != "a-ok" && o.xid == outcomes["a-ok"].xid {
			t.Errorf("%s committed in a-ok's transaction %s: the shared transaction had failing members, so each must have run alone", key, o.xid)
		}
	}
	switch {
	case mode == "optimistic" && reruns.Load() < int64(len(members)):
		t.Errorf("%d members ran again alone, want all %d", reruns.Load(), len(members))
	case mode == "optimistic" && l.tx.Optimistic():
		t.Error("after an optimistic transaction rolled back, shared transactions must use savepoints for a while")
	case mode != "optimistic" && reruns.Load() != 0:
		t.Errorf("%d members ran again alone, want none", reruns.Load())
	}
	if n := batchCount(t, pool, `SELECT count(*) FROM effects WHERE key = 'dropped'`); n != 0 {
		t.Errorf("a handler's rolled back savepoint left %d effects", n)
	}
	if n := batchCount(t, pool, `SELECT count(*) FROM processed_jobs WHERE idempotency_key = 'i-marker' AND last_error LIKE 'result is not valid JSON%'`); n != 1 {
		t.Errorf("i-marker: no error marker stored")
	}
	for key, check := range map[string]func(o *outcome) bool{
		"b-error":               func(o *outcome) bool { return o.err != nil && o.err.Error() == "boom" },
		"c-panic":               func(o *outcome) bool { return o.panicked == "oops" },
		"d-sql-error":           func(o *outcome) bool { return o.err != nil && strings.Contains(o.err.Error(), "22012") },
		"e-swallowed-sql-error": func(o *outcome) bool { return o.err != nil && strings.Contains(o.err.Error(), "ended or broke") },
		"g-refused-result":      func(o *outcome) bool { return IsPermanent(o.err) },
	} {
		o := outcomes[key]
		if !check(o) {
			t.Errorf("%s: error %v, panic %v", key, o.err, o.panicked)
		}
		if n := batchCount(t, pool, `SELECT count(*) FROM effects WHERE key = $1`, key); n != 0 {
			t.Errorf("%s: %d effects, want none", key, n)
		}
		want := 0
		if key == "g-refused-result" {
			want = 1 // recorded failed, in a transaction of its own after the rollback
		}
		if n := batchCount(t, pool, `SELECT count(*) FROM processed_jobs WHERE idempotency_key = $1 AND status IN ('failed', 'completed')`, key); n != want {
			t.Errorf("%s: %d ledger rows, want %d", key, n, want)
		}
	}
	if n := batchCount(t, pool, `SELECT count(*) FROM processed_jobs WHERE status = 'in_progress'`); n != 0 {
		t.Errorf("%d rows left in progress", n)
	}
}

// TestDoTxBatchedDuplicates: deliveries of one key in one burst take effect once; the
// others are answered from the cache or busy, never run.
func TestDoTxBatchedDuplicates(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, 2*time.Minute)
	pool := testenv.Postgres(t)
	var sizes []int
	var mu sync.Mutex
	l := New(pool, &Config{Committers: 1, ObserveBatch: func(_ string, size int) { mu.Lock(); sizes = append(sizes, size); mu.Unlock() }})
	l.tx.Budget, l.tx.Slow = time.Hour, time.Hour // shared, however slow the race detector makes the handlers
	defer l.Close()
	batchExec(t, pool, `CREATE TABLE effects (key text NOT NULL)`)
	release, waitHolder := holdExecutor(t, l, "holder")
	const dups = 20
	results := make([]Result, 2*dups)
	errs := make([]error, 2*dups)
	var wg sync.WaitGroup
	for i := range 2 * dups {
		key := "dup"
		if i%2 == 1 {
			key = fmt.Sprintf("other-%d", i) // distinct keys in between
		}
		wg.Go(func() {
			results[i], errs[i] = l.DoTx(ctx, batchReq(key), func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
				_, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1)`, key)
				return json.RawMessage(fmt.Sprintf(`{"run":%d}`, i)), err
			})
		})
	}
	waitQueued(t, l, 2*dups)
	release()
	wg.Wait()
	waitHolder()
	fresh, cached := 0, 0
	var first string
	for i := 0; i < 2*dups; i += 2 {
		switch {
		case errors.Is(errs[i], ErrBusy):
		case errs[i] != nil:
			t.Errorf("dup %d: %v", i, errs[i])
		case results[i].Cached:
			cached++
		default:
			fresh++
			first = string(results[i].Result)
		}
	}
	if fresh != 1 {
		t.Fatalf("%d fresh runs of one key, want 1", fresh)
	}
	for i := 0; i < 2*dups; i += 2 {
		if errs[i] == nil && !jsonSame(results[i].Result, first) {
			t.Errorf("dup %d answered %s, the run answered %s", i, results[i].Result, first)
		}
	}
	if n := batchCount(t, pool, `SELECT count(*) FROM effects WHERE key = 'dup'`); n != 1 {
		t.Fatalf("effects of dup = %d, want 1", n)
	}
	if n := batchCount(t, pool, `SELECT count(*) FROM effects WHERE key <> 'dup'`); n != dups {
		t.Fatalf("effects of other keys = %d, want %d", n, dups)
	}
	mu.Lock()
	defer mu.Unlock()
	t.Logf("1 run, %d cached, %d busy; transactions of %v deliveries", cached, dups-1-cached, sizes)
}

func jsonSame(a json.RawMessage, b string) bool {
	var x, y any
	return json.Unmarshal(a, &x) == nil && json.Unmarshal([]byte(b), &y) == nil && fmt.Sprint(x) == fmt.Sprint(y)
}

// TestDoTxBatchedLockedKeyAndCancel: a member whose key another session holds is busy
// after the lock timeout and costs nobody else; a member whose ctx ends while queued
// leaves without a trace.
func TestDoTxBatchedLockedKeyAndCancel(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, 2*time.Minute)
	pool := testenv.Postgres(t)
	l := New(pool, &Config{Committers: 1, ClaimLockTimeout: 200 * time.Millisecond, Lease: time.Minute})
	l.tx.Budget, l.tx.Slow = time.Hour, time.Hour // shared, however slow the race detector makes the handlers
	defer l.Close()
	batchExec(t, pool, `CREATE TABLE effects (key text NOT NULL)`)
	// An expired claim on "m-locked" whose row another transaction holds.
	if _, err := l.Claim(ctx, batchReq("m-locked")); err != nil {
		t.Fatal(err)
	}
	batchExec(t, pool, `UPDATE processed_jobs SET locked_until = now() - interval '1 second' WHERE idempotency_key = 'm-locked'`)
	locker, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer locker.Rollback(ctx)
	if _, err := locker.Exec(ctx, `SELECT 1 FROM processed_jobs WHERE idempotency_key = 'm-locked' FOR UPDATE`); err != nil {
		t.Fatal(err)
	}

	release, waitHolder := holdExecutor(t, l, "0-holder")
	keys := []string{"a-first", "m-locked", "z-last"}
	errs := make([]error, len(keys))
	var wg sync.WaitGroup
	for i, key := range keys {
		wg.Go(func() {
			_, errs[i] = l.DoTx(ctx, batchReq(key), func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
				_, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1)`, key)
				return nil, err
			})
		})
	}
	waitQueued(t, l, len(keys))
	cctx, cancel := context.WithCancel(ctx)
	cancelled := make(chan error)
	go func() {
		_, err := l.DoTx(cctx, batchReq("cancelled"), func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
			return nil, errors.New("ran")
		})
		cancelled <- err
	}()
	waitQueued(t, l, len(keys)+1)
	cancel()
	if err := <-cancelled; !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled while queued: %v, want context.Canceled", err)
	}
	if n := queued(l); n != len(keys) {
		t.Fatalf("%d queued after a cancel, want %d", n, len(keys))
	}
	release()
	wg.Wait()
	waitHolder()
	if errs[0] != nil || errs[2] != nil {
		t.Fatalf("members beside a locked key: %v, %v", errs[0], errs[2])
	}
	if !errors.Is(errs[1], ErrBusy) {
		t.Fatalf("locked key: %v, want ErrBusy", errs[1])
	}
	if n := batchCount(t, pool, `SELECT count(*) FROM effects`); n != 2 {
		t.Fatalf("effects = %d, want 2", n)
	}
	if n := batchCount(t, pool, `SELECT count(*) FROM processed_jobs WHERE idempotency_key = 'cancelled'`); n != 0 {
		t.Fatal("a cancelled delivery left a row")
	}
}

// TestDoTxBatchedCtxDoneAtItsTurn: a member whose ctx ends after its transaction took it
// is answered with ctx's error when its turn comes, without running.
func TestDoTxBatchedCtxDoneAtItsTurn(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	pool := testenv.Postgres(t)
	l := New(pool, &Config{Committers: 1})
	l.tx.Budget, l.tx.Slow = time.Hour, time.Hour // shared, however slow the race detector makes the handlers
	defer l.Close()
	release, waitHolder := holdExecutor(t, l, "0-holder")
	entered, gate := make(chan struct{}), make(chan struct{})
	var wg sync.WaitGroup
	var firstErr, secondErr error
	ran := false
	wg.Go(func() {
		_, firstErr = l.DoTx(ctx, batchReq("a-first"), func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
			close(entered)
			<-gate
			return nil, nil
		})
	})
	cctx, cancel := context.WithCancel(ctx)
	wg.Go(func() {
		_, secondErr = l.DoTx(cctx, batchReq("b-second"), func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
			ran = true
			return nil, nil
		})
	})
	waitQueued(t, l, 2)
	release()
	<-entered // both are in one transaction now
	cancel()
	close(gate)
	wg.Wait()
	waitHolder()
	if firstErr != nil {
		t.Fatalf("first member: %v", firstErr)
	}
	if !errors.Is(secondErr, context.Canceled) || ran {
		t.Fatalf("member cancelled before its turn: %v (ran %t), want context.Canceled without running", secondErr, ran)
	}
	if n := batchCount(t, pool, `SELECT count(*) FROM processed_jobs`); n != 2 {
		t.Fatalf("%d ledger rows, want the holder's and the first member's", n)
	}
}

// TestDoTxBatchedLostCommitAnswer: a COMMIT whose answer does not come in time (a
// deferred trigger makes it slow) has its connection dropped, which also asks the server
// to cancel it; each member learns the outcome from the transaction id taken at its
// claim. When the trigger gives in, nothing committed and every member gets an error;
// when it swallows the cancel, all committed and every member succeeds.
func TestDoTxBatchedLostCommitAnswer(t *testing.T) {
	t.Parallel()
	for _, commits := range []bool{false, true} {
		t.Run(fmt.Sprintf("commits=%t", commits), func(t *testing.T) {
			t.Parallel()
			testLostCommitAnswer(t, commits)
		})
	}
}

func testLostCommitAnswer(t *testing.T, commits bool) {
	ctx := testenv.Context(t, 2*time.Minute)
	pool := testenv.Postgres(t)
	var resolved sync.WaitGroup
	resolved.Add(3)
	l := New(pool, &Config{Committers: 1, WriteTimeout: lostCommitTimeout, ClaimLockTimeout: 100 * time.Millisecond,
		Observe: func(ev Event, _ string) {
			if ev == EventCommitResolved {
				resolved.Done()
			}
		}})
	l.tx.Budget, l.tx.Slow = time.Hour, time.Hour // shared, however slow the race detector makes the handlers
	defer l.Close()
	slowCommitOf(t, pool, "m-slow", commits)
	release, waitHolder := holdExecutor(t, l, "0-holder")
	keys := []string{"a-first", "m-slow", "z-last"}
	errs := make([]error, len(keys))
	var wg sync.WaitGroup
	for i, key := range keys {
		wg.Go(func() {
			_, errs[i] = l.DoTx(ctx, batchReq(key), func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
				_, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1)`, key)
				return json.RawMessage(`true`), err
			})
		})
	}
	waitQueued(t, l, len(keys))
	release()
	wg.Wait()
	waitHolder()
	allResolved := make(chan struct{})
	go func() { resolved.Wait(); close(allResolved) }()
	select { // one commit_resolved event per member
	case <-allResolved:
	case <-time.After(30 * time.Second):
		t.Fatalf("no commit_resolved event for every member: %v", errs)
	}
	for i, err := range errs {
		if commits && err != nil {
			t.Errorf("%s: %v, want success learned from the transaction id", keys[i], err)
		}
		if !commits && (err == nil || !strings.Contains(err.Error(), "aborted")) {
			t.Errorf("%s: %v, want an aborted commit", keys[i], err)
		}
	}
	want := 0
	if commits {
		want = 3
	}
	if n := batchCount(t, pool, `SELECT count(*) FROM effects`); n != want {
		t.Fatalf("effects = %d, want %d", n, want)
	}
	if n := batchCount(t, pool, `SELECT count(*) FROM processed_jobs WHERE idempotency_key <> '0-holder'`); n != want {
		t.Fatalf("ledger rows = %d, want %d", n, want)
	}
}

// lostCommitTimeout is the WriteTimeout of the lost-commit tests: short enough to cut a
// slow COMMIT, long enough that asking the server about it afterwards (the same budget)
// gets an answer on a box busy with the race detector and other packages' tests, and
// that the COMMIT has begun when the cancellation lands. The cancellation must land in
// the trigger: one that lands in the finish before it aborts the transaction whatever
// the trigger does (with 2 s, and once in a CI run with 4 s, the commits=true case
// aborted so). The tests take as long as this, not as long as the trigger's sleep.
const lostCommitTimeout = 10 * time.Second

// slowCommitOf creates the table effects and makes the COMMIT of a transaction that
// inserted key into it sleep for a minute (a deferred trigger): far longer than a
// WriteTimeout of lostCommitTimeout, so its answer is lost, and the cancellation that
// comes with the dropped connection ends the sleep. When commits, the trigger swallows
// the cancellation and the transaction commits all the same; else it aborts.
func slowCommitOf(t *testing.T, pool *pgxpool.Pool, key string, commits bool) {
	t.Helper()
	body := `PERFORM pg_sleep(60);`
	if commits {
		body = `BEGIN PERFORM pg_sleep(60); EXCEPTION WHEN query_canceled THEN NULL; END;`
	}
	batchExec(t, pool, `CREATE TABLE effects (key text NOT NULL)`)
	batchExec(t, pool, `CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN `+body+` RETURN NULL; END $$`)
	batchExec(t, pool, `CREATE CONSTRAINT TRIGGER slow AFTER INSERT ON effects DEFERRABLE INITIALLY DEFERRED
		FOR EACH ROW WHEN (NEW.key = '`+key+`') EXECUTE FUNCTION slow_commit()`)
}

// TestDoTxBatchedRestart stops a private Postgres with an immediate shutdown while a
// shared transaction waits for a member's fn, then restarts it: no member is answered
// success unless its row and effect are there, and every member answered success has
// them.
func TestDoTxBatchedRestart(t *testing.T) {
	t.Parallel()
	pg := testenv.StartPostgres(t)
	ctx := testenv.Context(t, 3*time.Minute)
	if err := testenv.Migrate(ctx, pg.URL); err != nil {
		t.Fatal(err)
	}
	pool := testenv.Pool(t, pg.URL)
	l := New(pool, &Config{Committers: 2, WriteTimeout: 5 * time.Second})
	l.tx.Budget, l.tx.Slow = time.Hour, time.Hour // shared, however slow the race detector makes the handlers
	defer l.Close()
	batchExec(t, pool, `CREATE TABLE effects (key text NOT NULL)`)

	succeeded := map[string]bool{}
	var mu sync.Mutex
	run := func(wg *sync.WaitGroup, key string, block func()) {
		wg.Go(func() {
			cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			defer cancel()
			_, err := l.DoTx(cctx, batchReq(key), func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
				if _, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1)`, key); err != nil {
					return nil, err
				}
				if block != nil {
					block()
				}
				return json.RawMessage(`{"ok":true}`), nil
			})
			mu.Lock()
			defer mu.Unlock()
			if err == nil {
				succeeded[key] = true
			}
		})
	}
	for round := range 3 {
		// A burst that shares transactions; one member, later in key order each round,
		// blocks its transaction until Postgres is stopped.
		const n = 40
		blocker := fmt.Sprintf("r%d-b%02d", round, 10+round*10)
		entered, stopped := make(chan struct{}), make(chan struct{})
		var wg sync.WaitGroup
		for i := range n {
			key := fmt.Sprintf("r%d-b%02d", round, i)
			var block func()
			if key == blocker {
				block = func() { close(entered); <-stopped }
			}
			run(&wg, key, block)
		}
		select {
		case <-entered:
		case <-time.After(time.Minute):
			t.Fatal("the blocking member never ran")
		}
		// Meanwhile the other committer carries later deliveries: they commit.
		var later sync.WaitGroup
		for i := range 10 {
			run(&later, fmt.Sprintf("r%d-c%02d", round, i), nil)
		}
		later.Wait()
		if err := pg.StopImmediate(); err != nil {
			t.Fatal(err)
		}
		close(stopped)
		time.Sleep(100 * time.Millisecond)
		if err := pg.Start(); err != nil {
			t.Fatal(err)
		}
		wg.Wait()
		pool.Reset()
		mu.Lock()
		if succeeded[blocker] {
			t.Fatalf("%s, whose transaction was cut by the stop, reported success", blocker)
		}
		for i := range 10 {
			if key := fmt.Sprintf("r%d-c%02d", round, i); !succeeded[key] {
				t.Errorf("%s, run beside the blocked transaction before the stop, failed", key)
			}
		}
		mu.Unlock()
	}
	rows, err := pool.Query(ctx, `
		SELECT coalesce(p.idempotency_key, e.key), coalesce(p.status, '(none)'), coalesce(e.n, 0)
		FROM processed_jobs p FULL JOIN (SELECT key, count(*) AS n FROM effects GROUP BY key) e ON e.key = p.idempotency_key`)
	if err != nil {
		t.Fatal(err)
	}
	recorded := map[string]bool{}
	for rows.Next() {
		var key, status string
		var effects int
		if err := rows.Scan(&key, &status, &effects); err != nil {
			t.Fatal(err)
		}
		if status != StatusCompleted || effects != 1 {
			t.Errorf("%s: status %s, %d effects; want completed with one effect, or neither", key, status, effects)
		}
		recorded[key] = true
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	for key := range succeeded {
		if !recorded[key] {
			t.Errorf("%s reported success but is not recorded", key)
		}
	}
	t.Logf("%d recorded, %d reported success (the others got errors and may be retried)", len(recorded), len(succeeded))
}

// BenchmarkDoTxShared compares DoTx in a transaction per delivery (DisableGroupCommit)
// with shared transactions at 1 (the default), 2, 4 and 8 committers, at parallelism 32,
// each run inserting one effect row; deliveries/tx is the mean size of a shared one:
//
//	go test -run '^$' -bench DoTxShared -benchtime 3s ./idempotency/
func BenchmarkDoTxShared(b *testing.B) {
	for _, committers := range []int{0, 1, 2, 4, 8} {
		shared := committers > 0
		name := "own-tx"
		if shared {
			name = fmt.Sprintf("shared-committers=%d", committers)
		}
		b.Run(name, func(b *testing.B) {
			pool := testenv.Pool(b, testenv.PostgresURL(b)+"&pool_max_conns=40")
			if _, err := pool.Exec(context.Background(), `CREATE TABLE effects (key text NOT NULL)`); err != nil {
				b.Fatal(err)
			}
			var batches, members atomic.Int64
			l := New(pool, &Config{DisableGroupCommit: !shared, Committers: committers, ObserveBatch: func(kind string, size int) {
				if kind == BatchTx {
					batches.Add(1)
					members.Add(int64(size))
				}
			}})
			b.Cleanup(l.Close)
			var seq sync.Mutex
			next := 0
			b.SetParallelism(16) // 32 goroutines on 2 cores
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					seq.Lock()
					next++
					key := fmt.Sprintf("k%d", next)
					seq.Unlock()
					_, err := l.DoTx(context.Background(), batchReq(key), func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
						_, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1)`, key)
						return nil, err
					})
					if err != nil {
						b.Error(err)
						return
					}
				}
			})
			if n := batches.Load(); n > 0 {
				b.ReportMetric(float64(members.Load())/float64(n), "deliveries/tx")
			}
		})
	}
}

// TestDoTxBatchedSlowHandlersRunAlone: handlers slower than the shared transaction's
// budget do not queue behind one another: once the budget is spent, the members still
// waiting give their claims back and run alone, side by side. Each key still runs once.
func TestDoTxBatchedSlowHandlersRunAlone(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	pool := testenv.Postgres(t)
	l := New(pool, &Config{Committers: 1})
	defer l.Close()
	batchExec(t, pool, `CREATE TABLE effects (key text NOT NULL, xid text NOT NULL)`)
	const n = 20
	var wg sync.WaitGroup
	start := time.Now()
	for i := range n {
		wg.Go(func() {
			key := fmt.Sprintf("slow-%02d", i)
			_, err := l.DoTx(ctx, batchReq(key), func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
				time.Sleep(20 * time.Millisecond)
				_, err := tx.Exec(ctx, `INSERT INTO effects SELECT $1, pg_current_xact_id()::text`, key)
				return nil, err
			})
			if err != nil {
				t.Errorf("%s: %v", key, err)
			}
		})
	}
	wg.Wait()
	took := time.Since(start)
	var effects, keys, transactions int
	if err := pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT key), count(DISTINCT xid) FROM effects`).Scan(&effects, &keys, &transactions); err != nil {
		t.Fatal(err)
	}
	if effects != n || keys != n {
		t.Fatalf("%d effects of %d keys, want %d of %d", effects, keys, n, n)
	}
	var completed int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM processed_jobs WHERE status = 'completed'`).Scan(&completed); err != nil || completed != n {
		t.Fatalf("%d completed rows (%v), want %d", completed, err, n)
	}
	// One after another, 20 handlers of 20 ms take 400 ms; most must have run alone.
	if transactions < n/2 {
		t.Errorf("%d handlers ran in %d transactions: slow handlers kept sharing", n, transactions)
	}
	t.Logf("%d slow handlers in %d transactions, %s", n, transactions, took.Round(time.Millisecond))
}

// TestDoTxBatchedSlowQueriesKeepSharing: a handler whose time goes to the database (as
// every handler's does on a saturated machine) is not slow: its deliveries keep sharing
// transactions. Only its time outside the database counts (TestDoTxBatchedSlowHandlersRunAlone
// is the other side). Handlers of 3 ms used to make every delivery run alone.
func TestDoTxBatchedSlowQueriesKeepSharing(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	pool := testenv.Postgres(t)
	l := New(pool, &Config{Committers: 1})
	defer l.Close()
	l.tx.Budget = time.Hour // every waiting member fits: only the slow switch can split them
	batchExec(t, pool, `CREATE TABLE effects (key text NOT NULL, xid text NOT NULL)`)
	run := func(key string) {
		_, err := l.DoTx(ctx, batchReq(key), func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
			_, err := tx.Exec(ctx, `INSERT INTO effects SELECT $1, pg_current_xact_id()::text FROM pg_sleep(0.003)`, key)
			return nil, err
		})
		if err != nil {
			t.Errorf("%s: %v", key, err)
		}
	}
	// First one at a time, so that the handlers' times are known; then all at once.
	for i := range 10 {
		run(fmt.Sprintf("first-%02d", i))
	}
	const n = 40
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { run(fmt.Sprintf("query-%02d", i)) })
	}
	wg.Wait()
	var effects, keys, transactions int
	if err := pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT key), count(DISTINCT xid) FROM effects WHERE key LIKE 'query-%'`).Scan(&effects, &keys, &transactions); err != nil {
		t.Fatal(err)
	}
	if effects != n || keys != n {
		t.Fatalf("%d effects of %d keys, want %d of %d", effects, keys, n, n)
	}
	if transactions > n/2 {
		t.Errorf("%d handlers ran in %d transactions: handlers waiting on the database stopped sharing", n, transactions)
	}
	t.Logf("%d handlers of 3 ms in the database, in %d transactions", n, transactions)
}

// TestDoTxBatchedLostCommitAnswerLaterMember: a member left for after the batch (its
// handler's turn came past the batch's budget, so it gave its claim back) is answered
// even when the batch's COMMIT answer is lost, and then runs alone. It used to wait for
// ever.
func TestDoTxBatchedLostCommitAnswerLaterMember(t *testing.T) {
	t.Parallel()
	for _, commits := range []bool{false, true} {
		t.Run(fmt.Sprintf("commits=%t", commits), func(t *testing.T) {
			t.Parallel()
			ctx := testenv.Context(t, 2*time.Minute)
			pool := testenv.Postgres(t)
			l := New(pool, &Config{Committers: 1, WriteTimeout: lostCommitTimeout, ClaimLockTimeout: 100 * time.Millisecond})
			l.tx.Budget, l.tx.Slow = 50*time.Millisecond, time.Hour // z-last's turn comes past the budget
			defer l.Close()
			slowCommitOf(t, pool, "m-slow", commits)
			release, waitHolder := holdExecutor(t, l, "0-holder")
			keys := []string{"a-first", "m-slow", "z-last"}
			errs := make([]error, len(keys))
			done := make(chan struct{})
			var wg sync.WaitGroup
			for i, key := range keys {
				wg.Go(func() {
					_, errs[i] = l.DoTx(ctx, batchReq(key), func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
						_, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1)`, key)
						if key == "m-slow" {
							time.Sleep(100 * time.Millisecond) // past the budget
						}
						return json.RawMessage(`true`), err
					})
				})
			}
			waitQueued(t, l, len(keys))
			release()
			go func() { wg.Wait(); close(done) }()
			select {
			case <-done:
			case <-time.After(time.Minute):
				t.Fatal("a member of the batch was never answered")
			}
			waitHolder()
			if errs[2] != nil {
				t.Errorf("z-last: %v, want success, alone after the batch", errs[2])
			}
			for i := range 2 {
				if commits && errs[i] != nil {
					t.Errorf("%s: %v, want success learned from the transaction id", keys[i], errs[i])
				}
				if !commits && (errs[i] == nil || !strings.Contains(errs[i].Error(), "aborted")) {
					t.Errorf("%s: %v, want an aborted commit", keys[i], errs[i])
				}
			}
			want := 1 // z-last alone
			if commits {
				want = 3
			}
			if n := batchCount(t, pool, `SELECT count(*) FROM effects`); n != want {
				t.Fatalf("effects = %d, want %d", n, want)
			}
			if n := batchCount(t, pool, `SELECT count(*) FROM processed_jobs WHERE idempotency_key <> '0-holder' AND status = 'completed'`); n != want {
				t.Fatalf("completed rows = %d, want %d", n, want)
			}
		})
	}
}

// TestDoTxOptimisticMembers: members of a shared transaction run without savepoints and
// their results are stored by its finish: all in one transaction when they succeed. When
// only the finish is refused (a result jsonb does not take), nothing commits and every
// member runs alone: the others succeed, the refused one fails for good.
func TestDoTxOptimisticMembers(t *testing.T) {
	t.Parallel()
	for _, refused := range []bool{false, true} {
		t.Run(fmt.Sprintf("refused=%t", refused), func(t *testing.T) {
			t.Parallel()
			ctx := testenv.Context(t, time.Minute)
			pool := testenv.Postgres(t)
			events := &eventCounts{}
			runs, reruns := events.of(EventSharedRun), events.of(EventSharedRerun)
			l := New(pool, &Config{Committers: 1, Observe: events.observe})
			l.tx.Budget, l.tx.Slow = time.Hour, time.Hour
			defer l.Close()
			batchExec(t, pool, `CREATE TABLE effects (key text NOT NULL, xid text NOT NULL)`)
			results := map[string]string{"a-ok": `{"a": 1}`, "m-marker": `{not json`, "z-ok": `"z"`}
			if refused {
				results["g-refused"] = `1e1000000` // valid JSON that jsonb refuses
			}
			release, waitHolder := holdExecutor(t, l, "0-holder")
			type outcome struct {
				res Result
				err error
			}
			var mu sync.Mutex
			outcomes := map[string]outcome{}
			var wg sync.WaitGroup
			for key, out := range results {
				wg.Go(func() {
					res, err := l.DoTx(ctx, batchReq(key), func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
						_, err := tx.Exec(ctx, `INSERT INTO effects SELECT $1, pg_current_xact_id()::text`, key)
						return json.RawMessage(out), err
					})
					mu.Lock()
					outcomes[key] = outcome{res, err}
					mu.Unlock()
				})
			}
			waitQueued(t, l, len(results))
			release()
			wg.Wait()
			waitHolder()

			for key := range results {
				o := outcomes[key]
				effects := batchCount(t, pool, `SELECT count(*) FROM effects WHERE key = $1`, key)
				if key == "g-refused" {
					if !IsPermanent(o.err) || effects != 0 {
						t.Errorf("%s: %v with %d effects, want a permanent failure and none", key, o.err, effects)
					}
					continue
				}
				if o.err != nil || effects != 1 {
					t.Fatalf("%s: %v with %d effects, want success and one", key, o.err, effects)
				}
				var stored *string
				var lastErr *string
				if err := pool.QueryRow(ctx, `SELECT result::text, last_error FROM processed_jobs WHERE idempotency_key = $1 AND status = 'completed'`, key).Scan(&stored, &lastErr); err != nil {
					t.Fatalf("%s: %v", key, err)
				}
				switch {
				case key == "m-marker" && (stored == nil || !strings.Contains(*stored, "idemq_error") || lastErr == nil):
					t.Errorf("%s: result %v, error %v; want the invalid result replaced by an error marker", key, stored, lastErr)
				case key != "m-marker" && (stored == nil || !jsonEqualText(*stored, results[key]) || !jsonEqualText(string(o.res.Result), results[key])):
					t.Errorf("%s: stored %v, answered %s; want %s", key, stored, o.res.Result, results[key])
				}
			}
			transactions := batchCount(t, pool, `SELECT count(DISTINCT xid) FROM effects`)
			switch {
			case !refused && (transactions != 1 || reruns.Load() != 0 || runs.Load() != 3):
				t.Errorf("%d transactions, %d runs without savepoints, %d reruns: want 1, 3 and 0", transactions, runs.Load(), reruns.Load())
			case refused && (transactions != 3 || reruns.Load() != 4):
				t.Errorf("%d transactions, %d reruns: want the 3 that succeed committed alone, all 4 run again", transactions, reruns.Load())
			}
		})
	}
}

// jsonEqualText reports whether a and b are the same JSON value.
func jsonEqualText(a, b string) bool {
	var x, y any
	return json.Unmarshal([]byte(a), &x) == nil && json.Unmarshal([]byte(b), &y) == nil && reflect.DeepEqual(x, y)
}

// TestDoTxSlowTurnsKeepTheirPlaces: members whose turns are slow only because their
// queries are (as every query is on a saturated machine) are not given back when the
// transaction runs past its budget: only the handlers' time outside the database spends
// it, or several budgets of wall time. Six handlers of 10 ms in the database, with a 40 ms
// budget, all share one transaction, each claimed once.
func TestDoTxSlowTurnsKeepTheirPlaces(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	pool := testenv.Postgres(t)
	events := &eventCounts{}
	givenBack, claimed := events.of(EventGivenBack), events.of(EventClaimed)
	l := New(pool, &Config{Committers: 1, Observe: events.observe})
	defer l.Close()
	// 40 ms: six 10 ms queries in a row exceed the budget (the old wall-time rule gave them
	// back) and stay well inside 5 × budget of wall time on a loaded machine.
	l.tx.Budget, l.tx.Slow = 40*time.Millisecond, time.Hour
	batchExec(t, pool, `CREATE TABLE effects (key text NOT NULL, xid text NOT NULL)`)
	release, waitHolder := holdExecutor(t, l, "0-holder")
	const n = 6
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			key := fmt.Sprintf("turn-%d", i)
			_, err := l.DoTx(ctx, batchReq(key), func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
				_, err := tx.Exec(ctx, `INSERT INTO effects SELECT $1, pg_current_xact_id()::text FROM pg_sleep(0.010)`, key)
				return nil, err
			})
			if err != nil {
				t.Errorf("%s: %v", key, err)
			}
		})
	}
	waitQueued(t, l, n)
	release()
	wg.Wait()
	waitHolder()
	var effects, transactions int
	if err := pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT xid) FROM effects`).Scan(&effects, &transactions); err != nil {
		t.Fatal(err)
	}
	if effects != n {
		t.Fatalf("%d effects, want %d", effects, n)
	}
	if givenBack.Load() != 0 || transactions != 1 {
		t.Errorf("%d members given back, %d transactions: quick handlers with slow queries lost their places", givenBack.Load(), transactions)
	}
	if got := claimed.Load(); got != n+1 {
		t.Errorf("%d claims for %d deliveries and the holder, want one each", got, n)
	}
}

// TestDoTxFinishConflict: a DoTx transaction writes its members' rows only at its finish,
// which re-checks each row on its newest version. When another claim completes a
// member's key while its handler runs (here a leased Do of the same key, which takes no
// advisory lock, as a permanent failure's claim or an operator's rerun would not), the
// finish refuses, the whole transaction rolls back (counted), its members run again, and
// the taken key answers the other claim's result: its effect happens once. The negative
// control, with the finish's re-check and guard off (UnsafeNoFencing), must find the
// effect twice.
func TestDoTxFinishConflict(t *testing.T) {
	t.Parallel()
	for _, unsafe := range []bool{false, true} {
		for _, shared := range []bool{false, true} {
			t.Run(fmt.Sprintf("unsafe=%t/shared=%t", unsafe, shared), func(t *testing.T) {
				t.Parallel()
				ctx := testenv.Context(t, time.Minute)
				pool := testenv.Postgres(t)
				events := &eventCounts{}
				conflicts, reruns := events.of(EventTxConflict), events.of(EventSharedRerun)
				l := New(pool, &Config{Committers: 1, UnsafeNoFencing: unsafe, DisableGroupCommit: !shared, Observe: events.observe})
				l.tx.Budget, l.tx.Slow = time.Hour, time.Hour
				defer l.Close()
				batchExec(t, pool, `CREATE TABLE effects (key text NOT NULL)`)

				var taken atomic.Bool
				run := func(key string) (Result, error) {
					return l.DoTx(ctx, batchReq(key), func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
						if _, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1)`, key); err != nil {
							return nil, err
						}
						if key == "k-taken" && taken.CompareAndSwap(false, true) {
							_, err := l.Do(ctx, batchReq(key), func(ctx context.Context) (json.RawMessage, error) {
								_, err := pool.Exec(ctx, `INSERT INTO effects VALUES ($1)`, key)
								return json.RawMessage(`"other"`), err
							})
							if err != nil {
								return nil, fmt.Errorf("the other claim: %w", err)
							}
						}
						return json.RawMessage(`"mine"`), nil
					})
				}
				keys := []string{"a-ok", "k-taken", "z-ok"}
				results, errs := make([]Result, len(keys)), make([]error, len(keys))
				var wg sync.WaitGroup
				if shared {
					release, waitHolder := holdExecutor(t, l, "0-holder")
					for i, key := range keys {
						wg.Go(func() { results[i], errs[i] = run(key) })
					}
					waitQueued(t, l, len(keys))
					release()
					wg.Wait()
					waitHolder()
				} else {
					for i, key := range keys {
						results[i], errs[i] = run(key)
					}
				}
				for i, key := range keys {
					if errs[i] != nil {
						t.Fatalf("%s: %v", key, errs[i])
					}
					want := 1
					if key == "k-taken" && unsafe {
						want = 2
					}
					if n := batchCount(t, pool, `SELECT count(*) FROM effects WHERE key = $1`, key); n != want {
						t.Errorf("%s: %d effects, want %d", key, n, want)
					}
				}
				if unsafe {
					return
				}
				if r := results[1]; !r.Cached || string(r.Result) != `"other"` {
					t.Errorf("k-taken: %+v, want the other claim's result, cached", r)
				}
				if n := conflicts.Load(); n != 1 {
					t.Errorf("%d conflicts counted, want 1", n)
				}
				if n := reruns.Load(); shared && n != 3 {
					t.Errorf("%d members ran again, want 3", n)
				}
			})
		}
	}
}

// TestDoTxAloneWaitsForTheKey: a delivery in a transaction of its own whose key another
// transaction holds waits for it, up to ClaimLockTimeout, and then sees that
// transaction's row (a cached result); past the timeout it is busy.
func TestDoTxAloneWaitsForTheKey(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	pool := testenv.Postgres(t)
	l := New(pool, &Config{DisableGroupCommit: true, ClaimLockTimeout: 3 * time.Second})
	defer l.Close()
	short := New(pool, &Config{DisableGroupCommit: true, ClaimLockTimeout: 100 * time.Millisecond})
	defer short.Close()
	for _, tc := range []struct {
		key    string
		l      *Ledger
		cached bool
	}{{"waits", l, true}, {"gives-up", short, false}} {
		entered, release := make(chan struct{}), make(chan struct{})
		first := make(chan error, 1)
		go func() {
			_, err := l.DoTx(ctx, batchReq(tc.key), func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
				close(entered)
				<-release
				return json.RawMessage(`"first"`), nil
			})
			first <- err
		}()
		<-entered
		time.AfterFunc(300*time.Millisecond, func() { close(release) })
		res, err := tc.l.DoTx(ctx, batchReq(tc.key), func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
			return json.RawMessage(`"second"`), nil
		})
		if ferr := <-first; ferr != nil {
			t.Fatalf("%s: first: %v", tc.key, ferr)
		}
		if tc.cached && (err != nil || !res.Cached || string(res.Result) != `"first"`) {
			t.Errorf("%s: second: %+v, %v; want the first's result, cached", tc.key, res, err)
		}
		if !tc.cached && !errors.Is(err, ErrBusy) {
			t.Errorf("%s: second: %+v, %v; want ErrBusy", tc.key, res, err)
		}
	}
}
