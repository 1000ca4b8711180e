package idempotency_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/internal/testledger"
)

// newLedger returns a ledger on a fresh schema of its own, and the pool.
// Shared helpers, under the names these tests use.
var (
	newLedger = testledger.New
	get       = testledger.Get
	jsonEqual = testledger.JSONEqual
	mustExec  = testenv.Exec
	count     = testenv.Count
)

func req(key string) idempotency.Request {
	return idempotency.Request{Key: key, TaskType: "test:task", Fingerprint: idempotency.Fingerprint("test:task", []byte(`{"k":"`+key+`"}`))}
}

// events counts Observe calls.
type events struct {
	mu sync.Mutex
	n  map[idempotency.Event]int
}

func (e *events) observe(ev idempotency.Event, _ string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.n == nil {
		e.n = map[idempotency.Event]int{}
	}
	e.n[ev]++
}

func (e *events) get(ev idempotency.Event) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.n[ev]
}

// waitBusy sleeps a little before a retry on busy.
func waitBusy(err error) bool {
	var be *idempotency.BusyError
	if !errors.As(err, &be) {
		return false
	}
	time.Sleep(5 * time.Millisecond)
	return true
}

func TestDoTxManyWorkersOneEffect(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, 2*time.Minute)
	ev := &events{}
	l, pool := newLedger(t, &idempotency.Config{Observe: ev.observe})
	// No unique constraint: only the ledger keeps the effect single.
	mustExec(t, pool, `CREATE TABLE effects (key text NOT NULL, worker int NOT NULL)`)

	const workers = 64
	results := make([]string, workers)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for {
				res, err := l.DoTx(ctx, req("debit:1"), func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
					if _, err := tx.Exec(ctx, `INSERT INTO effects VALUES ('debit:1', $1)`, w); err != nil {
						return nil, err
					}
					time.Sleep(2 * time.Millisecond) // widen the window
					return json.RawMessage(fmt.Sprintf(`{"worker":%d}`, w)), nil
				})
				if waitBusy(err) {
					continue
				}
				if err != nil {
					t.Errorf("worker %d: %v", w, err)
					return
				}
				results[w] = string(res.Result)
				return
			}
		})
	}
	wg.Wait()
	if n := count(t, pool, `SELECT count(*) FROM effects`); n != 1 {
		t.Fatalf("effects = %d, want 1", n)
	}
	for w := range workers {
		if !jsonEqual(json.RawMessage(results[w]), json.RawMessage(results[0])) {
			t.Fatalf("worker %d got %s, worker 0 got %s: want one answer", w, results[w], results[0])
		}
	}
	if got := ev.get(idempotency.EventClaimed); got != 1 {
		t.Errorf("claimed events = %d, want 1", got)
	}
	t.Logf("cache hits %d, busy %d", ev.get(idempotency.EventCacheHit), ev.get(idempotency.EventBusy))
}

func TestDoManyWorkersOneEffect(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, 2*time.Minute)
	l, _ := newLedger(t, &idempotency.Config{Lease: 5 * time.Second})
	var effects atomic.Int64
	const workers = 64
	results := make([]string, workers)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for {
				res, err := l.Do(ctx, req("charge:1"), func(ctx context.Context) (json.RawMessage, error) {
					n := effects.Add(1)
					time.Sleep(20 * time.Millisecond)
					return json.RawMessage(fmt.Sprintf(`{"effect":%d,"worker":%d}`, n, w)), nil
				})
				if waitBusy(err) {
					continue
				}
				if err != nil {
					t.Errorf("worker %d: %v", w, err)
					return
				}
				results[w] = string(res.Result)
				return
			}
		})
	}
	wg.Wait()
	if n := effects.Load(); n != 1 {
		t.Fatalf("effects = %d, want 1", n)
	}
	for w := range workers {
		if !jsonEqual(json.RawMessage(results[w]), json.RawMessage(results[0])) {
			t.Fatalf("worker %d got %s, worker 0 got %s", w, results[w], results[0])
		}
	}
}

func TestLeaseExpiryTakeover(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	ev := &events{}
	l, _ := newLedger(t, &idempotency.Config{Lease: 300 * time.Millisecond, Observe: ev.observe})

	first, err := l.Claim(ctx, req("k"))
	if err != nil || first.Claim == nil {
		t.Fatalf("first claim: %+v, %v", first, err)
	}
	if _, err := l.Claim(ctx, req("k")); !errors.Is(err, idempotency.ErrBusy) {
		t.Fatalf("claim during the lease: %v, want ErrBusy", err)
	}
	time.Sleep(400 * time.Millisecond)
	second, err := l.Claim(ctx, req("k"))
	if err != nil || second.Claim == nil {
		t.Fatalf("takeover: %+v, %v", second, err)
	}
	c1, c2 := first.Claim, second.Claim
	if c2.Fence <= c1.Fence || c2.Owner == c1.Owner || c2.Attempt != 2 {
		t.Fatalf("takeover fence %d owner %s attempt %d; first fence %d owner %s: want a larger fence, a new owner, attempt 2",
			c2.Fence, c2.Owner, c2.Attempt, c1.Fence, c1.Owner)
	}
	if _, err := l.Heartbeat(ctx, c1); !errors.Is(err, idempotency.ErrLeaseLost) {
		t.Fatalf("stale heartbeat: %v, want ErrLeaseLost", err)
	}
	if err := l.Complete(ctx, c1, json.RawMessage(`"first"`)); !errors.Is(err, idempotency.ErrLeaseLost) {
		t.Fatalf("stale complete: %v, want ErrLeaseLost", err)
	}
	if err := l.Fail(ctx, c1, errors.New("late")); !errors.Is(err, idempotency.ErrLeaseLost) {
		t.Fatalf("stale fail: %v, want ErrLeaseLost", err)
	}
	if _, err := l.Heartbeat(ctx, c2); err != nil {
		t.Fatalf("heartbeat of the new owner: %v", err)
	}
	if err := l.Complete(ctx, c2, json.RawMessage(`"second"`)); err != nil {
		t.Fatal(err)
	}
	r := get(t, l, "k")
	if r.Status != idempotency.StatusCompleted || string(r.Result) != `"second"` || r.Fence != c2.Fence || r.Attempts != 2 {
		t.Fatalf("row %+v: want completed with the second worker's result", r)
	}
	if got := ev.get(idempotency.EventLeaseLost); got != 3 {
		t.Errorf("lease_lost events = %d, want 3", got)
	}
	if got := ev.get(idempotency.EventTakeover); got != 1 {
		t.Errorf("takeover events = %d, want 1", got)
	}
}

func TestDoHeartbeatKeepsLease(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	// The work lasts more than two leases, so only heartbeats keep it; a lease of a
	// second leaves 900 ms for each heartbeat to land (with 300 ms, a run under the race
	// detector among the package's parallel tests self-fenced now and then).
	l, _ := newLedger(t, &idempotency.Config{Lease: time.Second})
	stop := make(chan struct{})
	var busy, other atomic.Int64
	var wg sync.WaitGroup
	defer wg.Wait()
	wg.Go(func() {
		for {
			select {
			case <-stop:
				return
			case <-time.After(50 * time.Millisecond):
			}
			cr, err := l.Claim(ctx, req("long"))
			switch {
			case errors.Is(err, idempotency.ErrBusy):
				busy.Add(1)
			case err == nil && cr.Completed != nil: // Do has just finished
			default:
				other.Add(1)
				t.Errorf("claim during a heartbeated lease: %+v, %v; want ErrBusy", cr, err)
			}
		}
	})
	res, err := l.Do(ctx, req("long"), func(ctx context.Context) (json.RawMessage, error) {
		select {
		case <-ctx.Done():
			return nil, context.Cause(ctx)
		case <-time.After(2500 * time.Millisecond):
		}
		key, fence, ok := idempotency.FromContext(ctx)
		return json.RawMessage(fmt.Sprintf(`{"key":%q,"fence":%d,"ok":%t}`, key, fence, ok)), nil
	})
	close(stop)
	if err != nil {
		t.Fatal(err)
	}
	want := fmt.Sprintf(`{"key":"long","fence":%d,"ok":true}`, res.Fence)
	if string(res.Result) != want {
		t.Fatalf("result %s, want %s", res.Result, want)
	}
	if busy.Load() == 0 {
		t.Fatal("no concurrent claim was attempted")
	}
}

func TestDoStolenLeaseCancelsHandler(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	l, pool := newLedger(t, &idempotency.Config{Lease: 300 * time.Millisecond})
	var stolenAt time.Time
	var cancelledAfter time.Duration
	var cause error
	_, err := l.Do(ctx, req("steal"), func(fctx context.Context) (json.RawMessage, error) {
		time.Sleep(150 * time.Millisecond)
		stolenAt = time.Now()
		mustExec(t, pool, `UPDATE processed_jobs SET fence = nextval('processed_jobs_fence_seq'), owner = gen_random_uuid() WHERE idempotency_key = 'steal'`)
		select {
		case <-fctx.Done():
			cancelledAfter = time.Since(stolenAt)
			cause = context.Cause(fctx)
			return nil, cause
		case <-time.After(5 * time.Second):
			return nil, errors.New("not cancelled")
		}
	})
	if !errors.Is(err, idempotency.ErrLeaseLost) || !errors.Is(cause, idempotency.ErrLeaseLost) {
		t.Fatalf("Do: %v (cause %v), want ErrLeaseLost", err, cause)
	}
	// One heartbeat interval is 100 ms; allow a lot more on a loaded machine.
	if cancelledAfter > 2*time.Second {
		t.Fatalf("handler cancelled %s after the steal, want about one heartbeat interval", cancelledAfter)
	}
	t.Logf("cancelled %s after the steal", cancelledAfter)
}

func TestRetryableFailureTakeoverAtOnce(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	l, _ := newLedger(t, &idempotency.Config{Lease: time.Hour})
	var fences []int64
	fn := func(ctx context.Context) (json.RawMessage, error) {
		_, fence, _ := idempotency.FromContext(ctx)
		fences = append(fences, fence)
		if len(fences) == 1 {
			return nil, errors.New("provider timeout")
		}
		return json.RawMessage(`{"ok":true}`), nil
	}
	if _, err := l.Do(ctx, req("r"), fn); err == nil || err.Error() != "provider timeout" {
		t.Fatalf("first run: %v, want the handler's error", err)
	}
	r := get(t, l, "r")
	if r.Status != idempotency.StatusInProgress || r.LastError != "provider timeout" {
		t.Fatalf("after a retryable failure: %+v", r)
	}
	// The lease is an hour, yet the retry takes over at once.
	res, err := l.Do(ctx, req("r"), fn)
	if err != nil {
		t.Fatal(err)
	}
	if len(fences) != 2 || fences[1] <= fences[0] || res.Attempts != 2 {
		t.Fatalf("fences %v attempts %d: want a second run with a larger fence", fences, res.Attempts)
	}
	if r := get(t, l, "r"); r.LastError != "provider timeout" || r.Attempts != 2 {
		t.Fatalf("last_error %q attempts %d: want both kept", r.LastError, r.Attempts)
	}
}

func TestPermanentFailureAndRerun(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	l, pool := newLedger(t, nil)
	mustExec(t, pool, `CREATE TABLE effects (key text NOT NULL)`)
	runs := 0
	_, err := l.Do(ctx, req("p"), func(ctx context.Context) (json.RawMessage, error) {
		runs++
		return nil, idempotency.Permanent(errors.New("card declined"))
	})
	if !idempotency.IsPermanent(err) {
		t.Fatalf("Do: %v, want the permanent error", err)
	}
	r := get(t, l, "p")
	if r.Status != idempotency.StatusFailed || r.LastError != "card declined" || r.CompletedAt.IsZero() {
		t.Fatalf("row %+v: want failed with last_error and completed_at", r)
	}
	var fe *idempotency.FailedError
	if _, err := l.Do(ctx, req("p"), nil); !errors.As(err, &fe) || !errors.Is(err, idempotency.ErrFailed) || fe.LastError != "card declined" {
		t.Fatalf("delivery of a failed key: %v, want *FailedError", err)
	}
	if _, err := l.DoTx(ctx, req("p"), nil); !errors.Is(err, idempotency.ErrFailed) {
		t.Fatalf("DoTx of a failed key: %v, want ErrFailed", err)
	}
	reopened, err := l.Rerun(ctx, "p")
	if gen := reopened.Generation; err != nil || gen != 1 {
		t.Fatalf("Rerun: %d, %v; want generation 1", gen, err)
	}
	res, err := l.Do(ctx, req("p"), func(ctx context.Context) (json.RawMessage, error) {
		runs++
		return json.RawMessage(`{"ok":1}`), nil
	})
	if err != nil || res.Generation != 1 || runs != 2 {
		t.Fatalf("after Rerun: %+v, %v, runs %d", res, err, runs)
	}
	if _, err := l.Rerun(ctx, "missing"); !errors.Is(err, idempotency.ErrNotFound) {
		t.Fatalf("Rerun of a missing key: %v", err)
	}
	c, _ := l.Claim(ctx, req("live"))
	if _, err := l.Rerun(ctx, "live"); !errors.Is(err, idempotency.ErrNotTerminal) {
		t.Fatalf("Rerun of a live key: %v, want ErrNotTerminal", err)
	}
	_ = c

	// DoTx: a permanent error rolls the effect back and records failed.
	_, err = l.DoTx(ctx, req("ptx"), func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
		if _, err := tx.Exec(ctx, `INSERT INTO effects VALUES ('ptx')`); err != nil {
			return nil, err
		}
		return nil, idempotency.Permanent(errors.New("insufficient funds"))
	})
	if !idempotency.IsPermanent(err) {
		t.Fatalf("DoTx: %v", err)
	}
	if n := count(t, pool, `SELECT count(*) FROM effects`); n != 0 {
		t.Fatalf("effects = %d after a permanent failure, want 0", n)
	}
	if r := get(t, l, "ptx"); r.Status != idempotency.StatusFailed || r.LastError != "insufficient funds" {
		t.Fatalf("row %+v: want failed", r)
	}
}

// TestDoTxPermanentFailureOfADecidedKey: a DoTx alone whose handler fails for good reads
// its key again after the rollback; when another delivery finished the key meanwhile, that
// one decides: DoTx answers its result and records nothing.
func TestDoTxPermanentFailureOfADecidedKey(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	ev := &events{}
	l, pool := newLedger(t, &idempotency.Config{Observe: ev.observe})
	mustExec(t, pool, `CREATE TABLE effects (key text NOT NULL)`)
	res, err := l.DoTx(ctx, req("decided"), func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
		if _, err := tx.Exec(ctx, `INSERT INTO effects VALUES ('decided')`); err != nil {
			return nil, err
		}
		// Another delivery, in leased mode (no advisory lock), completes the key meanwhile.
		if _, err := l.Do(ctx, req("decided"), func(context.Context) (json.RawMessage, error) {
			return json.RawMessage(`{"by":"other"}`), nil
		}); err != nil {
			return nil, err
		}
		return nil, idempotency.Permanent(errors.New("declined"))
	})
	if err != nil || !res.Cached || !jsonEqual(res.Result, json.RawMessage(`{"by":"other"}`)) {
		t.Fatalf("DoTx: %+v, %v; want the other delivery's cached result", res, err)
	}
	if r := get(t, l, "decided"); r.Status != idempotency.StatusCompleted || r.LastError != "" {
		t.Fatalf("row %+v: want the other delivery's completion", r)
	}
	if n := count(t, pool, `SELECT count(*) FROM effects`); n != 0 {
		t.Fatalf("effects = %d, want 0", n)
	}
	if got := ev.get(idempotency.EventFailed); got != 0 {
		t.Errorf("failed events = %d, want 0", got)
	}
	// Undecided, the key is recorded failed, once.
	if _, err := l.DoTx(ctx, req("declined"), func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
		return nil, idempotency.Permanent(errors.New("declined"))
	}); !idempotency.IsPermanent(err) {
		t.Fatalf("DoTx: %v, want the permanent error", err)
	}
	if r := get(t, l, "declined"); r.Status != idempotency.StatusFailed || r.LastError != "declined" || r.Attempts != 1 {
		t.Fatalf("row %+v: want failed at attempt 1", r)
	}
	if got := ev.get(idempotency.EventFailed); got != 1 {
		t.Errorf("failed events = %d, want 1", got)
	}
}

func TestDoTxErrorLeavesNoTraceAndFencesAreNotReused(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	l, pool := newLedger(t, nil)
	mustExec(t, pool, `CREATE TABLE effects (key text NOT NULL)`)
	var fences []int64
	for i := range 3 {
		_, err := l.DoTx(ctx, req("e"), func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
			_, fence, _ := idempotency.FromContext(ctx)
			fences = append(fences, fence)
			if _, err := tx.Exec(ctx, `INSERT INTO effects VALUES ('e')`); err != nil {
				return nil, err
			}
			if i < 2 {
				return nil, errors.New("boom")
			}
			return json.RawMessage(`1`), nil
		})
		if i < 2 {
			if err == nil || err.Error() != "boom" {
				t.Fatalf("run %d: %v, want boom", i, err)
			}
			if n := count(t, pool, `SELECT count(*) FROM effects`); n != 0 {
				t.Fatalf("effects after a failed run = %d", n)
			}
			if _, err := l.Get(ctx, "e"); !errors.Is(err, idempotency.ErrNotFound) {
				t.Fatalf("ledger row after a rolled back claim: %v, want ErrNotFound", err)
			}
		} else if err != nil {
			t.Fatal(err)
		}
	}
	for i := 1; i < len(fences); i++ {
		if fences[i] <= fences[i-1] {
			t.Fatalf("fences %v: a rolled back claim's fence was reused", fences)
		}
	}
	if r := get(t, l, "e"); r.Fence != fences[2] || r.Attempts != 1 {
		t.Fatalf("row %+v: want fence %d attempt 1 (rolled back claims leave no trace)", r, fences[2])
	}

	// A panic rolls back too, and panics again.
	func() {
		defer func() {
			if p := recover(); p != "oops" {
				t.Fatalf("recovered %v, want oops", p)
			}
		}()
		l.DoTx(ctx, req("panic"), func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
			tx.Exec(ctx, `INSERT INTO effects VALUES ('panic')`)
			panic("oops")
		})
	}()
	if n := count(t, pool, `SELECT count(*) FROM effects WHERE key = 'panic'`); n != 0 {
		t.Fatalf("effect of a panicking handler committed")
	}
	if _, err := l.Get(ctx, "panic"); !errors.Is(err, idempotency.ErrNotFound) {
		t.Fatalf("ledger row after a panic: %v", err)
	}

	// A handler cannot end the transaction: Commit and Rollback refuse, and a COMMIT sent
	// by hand is caught; nothing is recorded either way.
	_, err := l.DoTx(ctx, req("commits"), func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
		if err := tx.Commit(ctx); err == nil {
			t.Error("handler's Commit succeeded")
		}
		return nil, tx.Rollback(ctx)
	})
	if err == nil || !strings.Contains(err.Error(), "cannot commit or roll back") {
		t.Fatalf("handler calling Rollback: %v", err)
	}
	_, err = l.DoTx(ctx, req("commits"), func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
		_, err := tx.Exec(ctx, "COMMIT")
		return nil, err
	})
	if err == nil || !strings.Contains(err.Error(), "ended or broke") {
		t.Fatalf("handler sending COMMIT: %v", err)
	}
	if _, err := l.Get(ctx, "commits"); !errors.Is(err, idempotency.ErrNotFound) {
		// The hand-sent COMMIT committed the claim row, written completed: a handler that
		// breaks the contract is on its own, but DoTx reported it.
		t.Logf("after a hand-sent COMMIT: %v", err)
	}
}

func TestDoTxHandlerTx(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	l, pool := newLedger(t, nil)
	mustExec(t, pool, `CREATE TABLE effects (key text NOT NULL)`)
	res, err := l.DoTx(ctx, req("nested"), func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
		// A savepoint that rolls back keeps the rest.
		if err := pgx.BeginFunc(ctx, tx, func(sp pgx.Tx) error {
			sp.Exec(ctx, `INSERT INTO effects VALUES ('dropped')`)
			return errors.New("undo this part")
		}); err == nil {
			return nil, errors.New("nested BeginFunc: nil error")
		}
		if err := pgx.BeginFunc(ctx, tx, func(sp pgx.Tx) error {
			_, err := sp.Exec(ctx, `INSERT INTO effects VALUES ('kept')`)
			return err
		}); err != nil {
			return nil, err
		}
		if _, err := tx.CopyFrom(ctx, pgx.Identifier{"effects"}, []string{"key"}, pgx.CopyFromRows([][]any{{"copied"}})); err != nil {
			return nil, err
		}
		br := tx.SendBatch(ctx, &pgx.Batch{QueuedQueries: []*pgx.QueuedQuery{{SQL: `INSERT INTO effects VALUES ('batched')`}}})
		if err := br.Close(); err != nil {
			return nil, err
		}
		if _, err := tx.Prepare(ctx, "count_effects", `SELECT count(*) FROM effects`); err != nil {
			return nil, err
		}
		var n int
		if err := tx.QueryRow(ctx, "count_effects").Scan(&n); err != nil {
			return nil, err
		}
		rows, err := tx.Query(ctx, `SELECT key FROM effects ORDER BY key`)
		if err != nil {
			return nil, err
		}
		keys, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return nil, err
		}
		lo := tx.LargeObjects()
		oid, err := lo.Create(ctx, 0)
		if err != nil {
			return nil, err
		}
		if tx.Conn() == nil {
			return nil, errors.New("no Conn")
		}
		return json.Marshal(map[string]any{"n": n, "keys": keys, "lo": oid != 0})
	})
	if err != nil {
		t.Fatal(err)
	}
	if want := `{"keys":["batched","copied","kept"],"lo":true,"n":3}`; string(res.Result) != want {
		t.Fatalf("result %s, want %s", res.Result, want)
	}
	if n := count(t, pool, `SELECT count(*) FROM effects`); n != 3 {
		t.Fatalf("effects = %d, want 3", n)
	}
}

func TestDoPanicEndsLease(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	l, _ := newLedger(t, &idempotency.Config{Lease: time.Hour})
	func() {
		defer func() {
			if p := recover(); p != "oops" {
				t.Fatalf("recovered %v, want oops", p)
			}
		}()
		l.Do(ctx, req("panic"), func(ctx context.Context) (json.RawMessage, error) { panic("oops") })
	}()
	r := get(t, l, "panic")
	if r.Status != idempotency.StatusInProgress || !strings.Contains(r.LastError, "oops") || r.LockedUntil.After(time.Now().Add(time.Minute)) {
		t.Fatalf("row after a panic: %+v; want the lease ended with last_error", r)
	}
	if res, err := l.Do(ctx, req("panic"), func(ctx context.Context) (json.RawMessage, error) { return nil, nil }); err != nil || res.Attempts != 2 {
		t.Fatalf("retry after a panic: %+v, %v", res, err)
	}
}

func TestMismatch(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	l, _ := newLedger(t, nil)
	a := req("m")
	b := a
	b.Fingerprint = idempotency.Fingerprint("test:task", []byte(`{"other":1}`))
	var me *idempotency.MismatchError
	// In progress.
	if _, err := l.Claim(ctx, a); err != nil {
		t.Fatal(err)
	}
	if _, err := l.Claim(ctx, b); !errors.As(err, &me) || me.Key != "m" || !errors.Is(err, idempotency.ErrMismatch) {
		t.Fatalf("claim with another payload, in progress: %v", err)
	}
	// Completed: never serves the other payload's result.
	if _, err := l.Do(ctx, req("m2"), func(ctx context.Context) (json.RawMessage, error) { return json.RawMessage(`"secret"`), nil }); err != nil {
		t.Fatal(err)
	}
	b.Key = "m2"
	if _, err := l.Do(ctx, b, nil); !errors.Is(err, idempotency.ErrMismatch) {
		t.Fatalf("Do with another payload, completed: %v", err)
	}
	if _, err := l.DoTx(ctx, b, nil); !errors.Is(err, idempotency.ErrMismatch) {
		t.Fatalf("DoTx with another payload, completed: %v", err)
	}
	// A nil fingerprint is not compared.
	nofp := req("m2")
	nofp.Fingerprint = nil
	if res, err := l.Do(ctx, nofp, nil); err != nil || !res.Cached {
		t.Fatalf("Do without a fingerprint: %+v, %v", res, err)
	}
}

func TestInvalidInput(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	l, pool := newLedger(t, nil)
	for _, tc := range []struct {
		name, key, wantMsg string
	}{
		{"empty", "", "1..255"},
		{"256 bytes", strings.Repeat("k", 256), "256 bytes"},
		{"NUL", "a\x00b", "0x00"},
		{"space", "a b", "0x20"},
		{"non-ASCII", "clé", "0xc3"},
		{"DEL", "a\x7f", "0x7f"},
		{"tab", "a\tb", "0x09"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := idempotency.ValidateKey(tc.key)
			if !errors.Is(err, idempotency.ErrInvalidKey) || !strings.Contains(err.Error(), tc.wantMsg) {
				t.Fatalf("ValidateKey: %v, want ErrInvalidKey naming %q", err, tc.wantMsg)
			}
			r := req("x")
			r.Key = tc.key
			if _, err := l.Claim(ctx, r); !errors.Is(err, idempotency.ErrInvalidKey) {
				t.Fatalf("Claim: %v", err)
			}
			if _, err := l.Do(ctx, r, nil); !errors.Is(err, idempotency.ErrInvalidKey) {
				t.Fatalf("Do: %v", err)
			}
			if _, err := l.DoTx(ctx, r, nil); !errors.Is(err, idempotency.ErrInvalidKey) {
				t.Fatalf("DoTx: %v", err)
			}
			if strings.Contains(tc.key, "\x00") {
				return // text cannot carry NUL at all
			}
			_, err = pool.Exec(ctx, `INSERT INTO processed_jobs (idempotency_key, task_type, status, fence, owner, locked_until)
				VALUES ($1, 't', 'in_progress', 1, gen_random_uuid(), now())`, tc.key)
			var pgErr *pgconn.PgError
			if !errors.As(err, &pgErr) || pgErr.ConstraintName != "processed_jobs_key_check" {
				t.Fatalf("direct insert: %v, want the key CHECK to refuse it", err)
			}
		})
	}
	for _, good := range []string{"a", strings.Repeat("k", 255), "charge:order-123", "!~"} {
		if err := idempotency.ValidateKey(good); err != nil {
			t.Errorf("ValidateKey(%q): %v", good, err)
		}
	}
	bad := []idempotency.Request{
		{Key: "k", TaskType: ""},
		{Key: "k", TaskType: strings.Repeat("t", 256)},
		{Key: "k", TaskType: "t", Fingerprint: []byte{1, 2, 3}},
	}
	for _, r := range bad {
		if _, err := l.Claim(ctx, r); !errors.Is(err, idempotency.ErrInvalidRequest) {
			t.Errorf("Claim(%+v): %v, want ErrInvalidRequest", r, err)
		}
	}
	if _, err := l.List(ctx, "bogus", 1); !errors.Is(err, idempotency.ErrInvalidRequest) {
		t.Errorf("List(bogus): %v", err)
	}
	if _, err := l.Purge(ctx, -time.Second, 1); !errors.Is(err, idempotency.ErrInvalidRequest) {
		t.Errorf("Purge(-1s): %v", err)
	}
	r := req("late")
	r.Deadline = time.Now().Add(-time.Second)
	if _, err := l.Claim(ctx, r); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Claim past the deadline: %v", err)
	}
}

func TestInvalidResultsCompleteWithMarker(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	ev := &events{}
	l, pool := newLedger(t, &idempotency.Config{MaxResultBytes: 64, Observe: ev.observe})
	mustExec(t, pool, `CREATE TABLE effects (key text NOT NULL)`)
	for i, tc := range []struct {
		name, result, want string
	}{
		{"oversized", `"` + strings.Repeat("x", 100) + `"`, "result too large: 102 bytes > limit 64"},
		{"not JSON", `{"a":`, "not valid JSON"},
		{"invalid UTF-8", "\"\xff\"", "not valid JSON"},
		{"NUL escape", `{"a":"\u0000"}`, `\u0000`},
		{"lone high surrogate", `"\ud800x"`, "unpaired surrogate"},
		{"lone low surrogate", `"\udc00"`, "unpaired surrogate"},
	} {
		for _, mode := range []string{"Do", "DoTx"} {
			key := fmt.Sprintf("bad-%d-%s", i, mode)
			runs := 0
			run := func() (idempotency.Result, error) {
				if mode == "Do" {
					return l.Do(ctx, req(key), func(ctx context.Context) (json.RawMessage, error) {
						runs++
						return json.RawMessage(tc.result), nil
					})
				}
				return l.DoTx(ctx, req(key), func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
					runs++
					_, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1)`, key)
					return json.RawMessage(tc.result), err
				})
			}
			res, err := run()
			if err != nil {
				t.Fatalf("%s %s: %v", tc.name, mode, err)
			}
			var marker struct {
				Err string `json:"idemq_error"`
			}
			if err := json.Unmarshal(res.Result, &marker); err != nil || !strings.Contains(marker.Err, tc.want) {
				t.Fatalf("%s %s: result %s, want a marker containing %q", tc.name, mode, res.Result, tc.want)
			}
			again, err := run()
			if err != nil || !again.Cached || string(again.Result) != string(res.Result) && !jsonEqual(again.Result, res.Result) || runs != 1 {
				t.Fatalf("%s %s: second delivery %+v, %v, runs %d: want the cached marker, no re-run", tc.name, mode, again, err, runs)
			}
			if r := get(t, l, key); r.Status != idempotency.StatusCompleted || !strings.Contains(r.LastError, tc.want) {
				t.Fatalf("%s %s: row %+v", tc.name, mode, r)
			}
		}
	}
	if n := count(t, pool, `SELECT count(*) FROM effects`); n != 6 {
		t.Fatalf("effects = %d, want 6 (each DoTx effect kept with its marker)", n)
	}

	// A number jsonb cannot hold passes the Go checks; the database refuses it.
	res, err := l.Do(ctx, req("huge-number"), func(ctx context.Context) (json.RawMessage, error) { return json.RawMessage(`1e1000000`), nil })
	if err != nil {
		t.Fatalf("Do with a number jsonb refuses: %v", err)
	}
	if r := get(t, l, "huge-number"); r.Status != idempotency.StatusCompleted || !strings.Contains(r.LastError, "refused by the database") {
		t.Fatalf("row %+v, result %s: want completed with a marker", r, res.Result)
	}
	_, err = l.DoTx(ctx, req("huge-number-tx"), func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
		_, err := tx.Exec(ctx, `INSERT INTO effects VALUES ('huge')`)
		return json.RawMessage(`1e1000000`), err
	})
	if !idempotency.IsPermanent(err) {
		t.Fatalf("DoTx with a number jsonb refuses: %v, want a permanent error", err)
	}
	if r := get(t, l, "huge-number-tx"); r.Status != idempotency.StatusFailed {
		t.Fatalf("row %+v: want failed (the effect rolled back with the refused result)", r)
	}
	if n := count(t, pool, `SELECT count(*) FROM effects WHERE key = 'huge'`); n != 0 {
		t.Fatalf("effect kept without a completion")
	}
	if ev.get(idempotency.EventBadResult) < 13 {
		t.Errorf("bad_result events = %d, want >= 13", ev.get(idempotency.EventBadResult))
	}

	// A nil result is stored as NULL and served as nil.
	res, err = l.Do(ctx, req("nil"), func(ctx context.Context) (json.RawMessage, error) { return nil, nil })
	if err != nil || res.Result != nil {
		t.Fatalf("nil result: %+v, %v", res, err)
	}
	if res, err := l.Do(ctx, req("nil"), nil); err != nil || res.Result != nil || !res.Cached {
		t.Fatalf("cached nil result: %+v, %v", res, err)
	}
}

// jsonEqual compares JSON values (jsonb normalises the spacing of stored results).
func TestValidateResult(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		in string
		ok bool
	}{
		{``, true},
		{`{"a":[1,2,{"b":null}]}`, true},
		{`"\\u0000"`, true}, // an escaped backslash, then text
		{`"\ud83d\ude00"`, true},
		{`"\u00e9\n\t\""`, true},
		{`"\u0000"`, false},
		{`"\uD800"`, false},
		{`"\uD800\u0041"`, false},
		{`"\uDFFF"`, false},
		{`nope`, false},
	} {
		err := idempotency.ValidateResult(json.RawMessage(tc.in), 1<<20)
		if (err == nil) != tc.ok {
			t.Errorf("ValidateResult(%s) = %v, want ok=%t", tc.in, err, tc.ok)
		}
	}
}

func TestBusyAndLockTimeout(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	l, pool := newLedger(t, &idempotency.Config{ClaimLockTimeout: 200 * time.Millisecond, Lease: time.Minute})
	first, err := l.Claim(ctx, req("b"))
	if err != nil {
		t.Fatal(err)
	}
	var be *idempotency.BusyError
	if _, err := l.Claim(ctx, req("b")); !errors.As(err, &be) || be.Fence != first.Claim.Fence || be.Owner != first.Claim.Owner || !be.Until.Equal(first.Claim.LeaseUntil) {
		t.Fatalf("busy: %v (%+v), want the holder's fence, owner and lease end", err, be)
	}
	if !strings.Contains(be.Error(), first.Claim.Owner) {
		t.Fatalf("busy message %q does not name the owner", be.Error())
	}
	if _, err := l.DoTx(ctx, req("b"), nil); !errors.Is(err, idempotency.ErrBusy) {
		t.Fatalf("DoTx on a leased key: %v", err)
	}

	// A transaction holding the row: the claim waits ClaimLockTimeout, then reports busy.
	mustExec(t, pool, `UPDATE processed_jobs SET locked_until = now() - interval '1 second' WHERE idempotency_key = 'b'`)
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `SELECT 1 FROM processed_jobs WHERE idempotency_key = 'b' FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	for _, mode := range []string{"Claim", "DoTx"} {
		start := time.Now()
		if mode == "Claim" {
			_, err = l.Claim(ctx, req("b"))
		} else {
			_, err = l.DoTx(ctx, req("b"), func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) { return nil, nil })
		}
		var pgErr *pgconn.PgError
		if !errors.Is(err, idempotency.ErrBusy) || !errors.As(err, &pgErr) || pgErr.Code != "55P03" {
			t.Fatalf("%s on a locked row: %v, want ErrBusy from a lock timeout", mode, err)
		}
		if d := time.Since(start); d > 10*time.Second {
			t.Fatalf("%s waited %s", mode, d)
		}
	}
	tx.Rollback(ctx)

	// DoTx restores the session's lock_timeout for the handler.
	_, err = l.DoTx(ctx, req("lt"), func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
		var lt, sc, idle string
		err := tx.QueryRow(ctx, `SELECT current_setting('lock_timeout'), current_setting('synchronous_commit'), current_setting('idle_in_transaction_session_timeout')`).Scan(&lt, &sc, &idle)
		if err == nil && (lt != "0" || sc != "on" || idle != "30s") {
			err = fmt.Errorf("lock_timeout %s synchronous_commit %s idle timeout %s; want 0, on, 30s", lt, sc, idle)
		}
		return nil, err
	})
	if err != nil {
		t.Fatal(err)
	}
}

func TestDeadlineCapsLease(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	l, _ := newLedger(t, &idempotency.Config{Lease: time.Hour})
	r := req("d")
	r.Deadline = time.Now().Add(2 * time.Second)
	cr, err := l.Claim(ctx, r)
	if err != nil {
		t.Fatal(err)
	}
	if d := time.Until(cr.Claim.LeaseUntil); d > 3*time.Second {
		t.Fatalf("lease ends in %s, want no later than the 2s deadline", d)
	}
	until, err := l.Heartbeat(ctx, cr.Claim)
	if err != nil || time.Until(until) > 3*time.Second {
		t.Fatalf("heartbeat: %s, %v; want capped at the deadline", until, err)
	}
	// DoTx bounds the idle timeout by the deadline.
	r.Key = "dtx"
	_, err = l.DoTx(ctx, r, func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
		var ms int
		err := tx.QueryRow(ctx, `SELECT setting::int FROM pg_settings WHERE name = 'idle_in_transaction_session_timeout'`).Scan(&ms)
		if err == nil && (ms > 2000 || ms < 1) {
			err = fmt.Errorf("idle timeout %d ms, want at most the 2s deadline", ms)
		}
		return nil, err
	})
	if err != nil {
		t.Fatal(err)
	}
}

func TestReleaseGetList(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	l, _ := newLedger(t, &idempotency.Config{Lease: time.Hour})
	first, err := l.Claim(ctx, req("rel"))
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Release(ctx, "rel"); err != nil {
		t.Fatal(err)
	}
	if _, err := l.Heartbeat(ctx, first.Claim); !errors.Is(err, idempotency.ErrLeaseLost) {
		t.Fatalf("heartbeat after Release: %v", err)
	}
	second, err := l.Claim(ctx, req("rel"))
	if err != nil || second.Claim == nil || second.Claim.Fence <= first.Claim.Fence {
		t.Fatalf("claim after Release: %+v, %v", second, err)
	}
	if err := l.Complete(ctx, second.Claim, json.RawMessage(`{"v":1}`)); err != nil {
		t.Fatal(err)
	}
	if err := l.Release(ctx, "rel"); !errors.Is(err, idempotency.ErrNotInProgress) {
		t.Fatalf("Release of a completed key: %v", err)
	}
	if err := l.Release(ctx, "nope"); !errors.Is(err, idempotency.ErrNotFound) {
		t.Fatalf("Release of a missing key: %v", err)
	}
	if _, err := l.Get(ctx, "nope"); !errors.Is(err, idempotency.ErrNotFound) {
		t.Fatalf("Get of a missing key: %v", err)
	}
	if got, err := l.GetMany(ctx, []string{"rel", "nope"}); err != nil || len(got) != 1 || got["rel"] == nil || got["rel"].Fence != second.Claim.Fence || got["rel"].Status != idempotency.StatusCompleted {
		t.Fatalf("GetMany of rel and a missing key: %+v, %v", got, err)
	}
	if _, err := l.Claim(ctx, req("live")); err != nil {
		t.Fatal(err)
	}
	all, err := l.List(ctx, "", 0)
	if err != nil || len(all) != 2 {
		t.Fatalf("List all: %d rows, %v", len(all), err)
	}
	done, err := l.List(ctx, idempotency.StatusCompleted, 10)
	if err != nil || len(done) != 1 || done[0].Key != "rel" || string(done[0].Result) != `{"v": 1}` || done[0].Owner != second.Claim.Owner {
		t.Fatalf("List completed: %+v, %v", done, err)
	}
}

func TestPurgeAndMaxAge(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	l, pool := newLedger(t, &idempotency.Config{MaxAge: time.Hour})
	ins := `INSERT INTO processed_jobs (idempotency_key, task_type, status, fence, owner, locked_until, started_at, completed_at)
		VALUES ($1, 't', $2, nextval('processed_jobs_fence_seq'), gen_random_uuid(), now() + $3::interval, now() - $4::interval, $5)`
	old := time.Now().Add(-2 * time.Hour)
	mustExec(t, pool, ins, "done-old", "completed", "0s", "3h", old)
	mustExec(t, pool, ins, "failed-old", "failed", "0s", "3h", old)
	mustExec(t, pool, ins, "done-new", "completed", "0s", "1m", time.Now())
	mustExec(t, pool, ins, "stuck", "in_progress", "-1h", "3h", nil)
	mustExec(t, pool, ins, "stuck-claimed", "in_progress", "-1h", "3h", nil)
	mustExec(t, pool, ins, "stuck-tx", "in_progress", "-1h", "3h", nil)
	mustExec(t, pool, ins, "old-but-live", "in_progress", "1h", "3h", nil)
	mustExec(t, pool, ins, "young-expired", "in_progress", "-1m", "1m", nil)
	mustExec(t, pool, ins, "attention", "needs_attention", "-1h", "3h", nil)

	// A delivery meeting a stuck key marks it instead of running it.
	if _, err := l.Do(ctx, idempotency.Request{Key: "stuck-claimed", TaskType: "t"}, func(ctx context.Context) (json.RawMessage, error) {
		t.Fatal("ran a key older than the maximum age")
		return nil, nil
	}); !errors.Is(err, idempotency.ErrNeedsAttention) {
		t.Fatalf("Do on a stuck key: %v, want ErrNeedsAttention", err)
	}
	if r := get(t, l, "stuck-claimed"); r.Status != idempotency.StatusNeedsAttention {
		t.Fatalf("stuck-claimed is %s", r.Status)
	}
	if _, err := l.DoTx(ctx, idempotency.Request{Key: "stuck-tx", TaskType: "t"}, func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
		t.Fatal("DoTx ran a key older than the maximum age")
		return nil, nil
	}); !errors.Is(err, idempotency.ErrNeedsAttention) {
		t.Fatalf("DoTx on a stuck key: %v, want ErrNeedsAttention", err)
	}
	if r := get(t, l, "stuck-tx"); r.Status != idempotency.StatusNeedsAttention {
		t.Fatalf("stuck-tx is %s", r.Status)
	}
	n, err := l.MarkStuck(ctx)
	if err != nil || n != 1 {
		t.Fatalf("MarkStuck: %d, %v; want 1 (stuck)", n, err)
	}
	for key, want := range map[string]string{"stuck": "needs_attention", "old-but-live": "in_progress", "young-expired": "in_progress"} {
		if r := get(t, l, key); r.Status != want {
			t.Errorf("%s is %s, want %s", key, r.Status, want)
		}
	}
	if _, err := l.DoTx(ctx, idempotency.Request{Key: "stuck", TaskType: "t"}, nil); !errors.Is(err, idempotency.ErrNeedsAttention) {
		t.Fatalf("DoTx on a needs_attention key: %v", err)
	}
	if reopened, err := l.Rerun(ctx, "stuck"); err != nil || reopened.Generation != 1 {
		t.Fatalf("Rerun of a needs_attention key: %d, %v", reopened.Generation, err)
	}
	if res, err := l.Do(ctx, idempotency.Request{Key: "stuck", TaskType: "t"}, func(ctx context.Context) (json.RawMessage, error) { return nil, nil }); err != nil || res.Generation != 1 {
		t.Fatalf("Do after Rerun: %+v, %v", res, err)
	}

	purged, err := l.Purge(ctx, time.Hour, 1)
	if err != nil || purged != 2 {
		t.Fatalf("Purge: %d, %v; want 2", purged, err)
	}
	for _, key := range []string{"done-old", "failed-old"} {
		if _, err := l.Get(ctx, key); !errors.Is(err, idempotency.ErrNotFound) {
			t.Errorf("%s after Purge: %v", key, err)
		}
	}
	if n := count(t, pool, `SELECT count(*) FROM processed_jobs`); n != 7 {
		t.Fatalf("%d rows left, want 7", n)
	}
	if purged, err := l.Purge(ctx, time.Hour, 0); err != nil || purged != 0 {
		t.Fatalf("second Purge: %d, %v", purged, err)
	}
}

func TestFromContextOutside(t *testing.T) {
	t.Parallel()
	if _, _, ok := idempotency.FromContext(context.Background()); ok {
		t.Fatal("FromContext outside a handler: ok")
	}
	if idempotency.Permanent(nil) != nil || idempotency.IsPermanent(errors.New("x")) {
		t.Fatal("Permanent(nil) or IsPermanent of a plain error")
	}
	if got := idempotency.Permanent(errors.New("x")).Error(); got != "x" {
		t.Fatalf("Permanent message %q", got)
	}
	fe := &idempotency.FailedError{Key: "k", LastError: "e"}
	me := &idempotency.MismatchError{Key: "k"}
	be := &idempotency.BusyError{Key: "k"}
	for _, e := range []error{fe, me, be} {
		if !strings.Contains(e.Error(), `"k"`) {
			t.Errorf("%T message %q does not name the key", e, e.Error())
		}
	}
}

func TestDoTxFencedStore(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	l, pool := newLedger(t, nil)
	mustExec(t, pool, `CREATE TABLE effects (key text NOT NULL)`)
	// A handler that writes the ledger row itself (as another owner would) cannot commit
	// its effect: the finish finds a row its read did not, so everything rolls back, and
	// after the reruns (each finding the same) the key is reported busy.
	_, err := l.DoTx(ctx, req("tamper"), func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
		if _, err := tx.Exec(ctx, `INSERT INTO effects VALUES ('tamper')`); err != nil {
			return nil, err
		}
		_, err := tx.Exec(ctx, `INSERT INTO processed_jobs (idempotency_key, task_type, status, fence, owner, attempts, completed_at)
			VALUES ('tamper', 't', 'completed', nextval('processed_jobs_fence_seq'), gen_random_uuid(), 1, now())`)
		return json.RawMessage(`{"ok":true}`), err
	})
	if !errors.Is(err, idempotency.ErrBusy) {
		t.Fatalf("DoTx with the row taken: %v, want ErrBusy", err)
	}
	if n := count(t, pool, `SELECT count(*) FROM effects`); n != 0 {
		t.Fatalf("effects = %d, want 0", n)
	}
	if _, err := l.Get(ctx, "tamper"); !errors.Is(err, idempotency.ErrNotFound) {
		t.Fatalf("ledger row: %v, want none", err)
	}
}

func TestRerunRepublishesTheIntentUnderTheNextTaskID(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	l, pool := newLedger(t, nil)
	done := func(key string) {
		t.Helper()
		if _, err := l.Do(ctx, req(key), func(ctx context.Context) (json.RawMessage, error) { return json.RawMessage(`{}`), nil }); err != nil {
			t.Fatal(err)
		}
	}
	done("no-intent")
	done("republished")
	// Its intent was republished three times by the reconciler (key#r3) and settled.
	mustExec(t, pool, `INSERT INTO job_intents (idempotency_key, task_type, payload, payload_sha256, queue, max_retry, timeout_ms, retention_ms,
		state, publish_generation, published_at, finished_at)
		VALUES ('republished', 't', '{}', sha256('{}'), 'default', 3, 1000, 1000, 'done', 3, now(), now())`)

	r, err := l.Rerun(ctx, "no-intent")
	if err != nil || r.Generation != 1 || r.TaskID != "" {
		t.Fatalf("Rerun of a key without an intent: %+v, %v; want generation 1, no TaskID", r, err)
	}
	r, err = l.Rerun(ctx, "republished")
	if err != nil || r.Generation != 1 || r.TaskID != "republished#r4" {
		t.Fatalf("Rerun: %+v, %v; want generation 1, TaskID republished#r4", r, err)
	}
	var state string
	var gen int
	var finished *time.Time
	if err := pool.QueryRow(ctx, `SELECT state, publish_generation, finished_at FROM job_intents WHERE idempotency_key = 'republished'`).Scan(&state, &gen, &finished); err != nil {
		t.Fatal(err)
	}
	if state != "pending" || gen != 4 || finished != nil {
		t.Fatalf("intent after Rerun: %s, publish generation %d, finished %v; want pending under 4, not finished", state, gen, finished)
	}
	if rec := get(t, l, "republished"); rec.Status != idempotency.StatusInProgress || rec.LeaseLive {
		t.Fatalf("row after Rerun: %s, lease live %v; want in_progress with a lapsed lease", rec.Status, rec.LeaseLive)
	}
	// A refused rerun leaves the intent alone.
	if _, err := l.Rerun(ctx, "republished"); !errors.Is(err, idempotency.ErrNotTerminal) {
		t.Fatalf("second Rerun: %v, want ErrNotTerminal", err)
	}
	if err := pool.QueryRow(ctx, `SELECT publish_generation FROM job_intents WHERE idempotency_key = 'republished'`).Scan(&gen); err != nil || gen != 4 {
		t.Fatalf("publish generation after a refused Rerun: %d, %v; want 4", gen, err)
	}
}

// A job whose task asynq archived after its retries ran out leaves its row in progress
// under a lapsed lease and its intent dead (the reconciler settles it): Rerun takes it,
// so the job can run again. Without a dead intent, such a row is refused as before.
func TestRerunRevivesAJobWhoseTaskWasArchived(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	l, pool := newLedger(t, nil)
	for _, key := range []string{"archived", "published"} {
		if _, err := l.Do(ctx, req(key), func(context.Context) (json.RawMessage, error) {
			return nil, errors.New("provider down") // retryable: the lease ends at once
		}); err == nil {
			t.Fatal("the handler's error was not returned")
		}
	}
	mustExec(t, pool, `INSERT INTO job_intents (idempotency_key, task_type, payload, payload_sha256, queue, max_retry, timeout_ms, retention_ms,
		state, publish_generation, published_at, finished_at, last_error)
		VALUES ('archived', 't', '{}', sha256('{}'), 'default', 0, 1000, 1000, 'dead', 0, now(), now(), 'archived: provider down'),
		       ('published', 't', '{}', sha256('{}'), 'default', 0, 1000, 1000, 'published', 0, now(), NULL, NULL)`)

	if _, err := l.Rerun(ctx, "published"); !errors.Is(err, idempotency.ErrNotTerminal) {
		t.Fatalf("Rerun of an in-progress key whose intent is live: %v, want ErrNotTerminal", err)
	}
	r, err := l.Rerun(ctx, "archived")
	if err != nil || r.Generation != 1 || r.TaskID != "archived#r1" {
		t.Fatalf("Rerun of an archived job: %+v, %v; want generation 1, TaskID archived#r1", r, err)
	}
	var state string
	if err := pool.QueryRow(ctx, `SELECT state FROM job_intents WHERE idempotency_key = 'archived'`).Scan(&state); err != nil || state != "pending" {
		t.Fatalf("intent after Rerun: %s, %v; want pending", state, err)
	}
}
