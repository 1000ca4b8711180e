package asynqmw_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/asynqmw"
	"github.com/idemq/idemq/idempotency/outbox"
	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/lock"
	"github.com/idemq/idemq/tasks"
)

// mwFixture is a Worker on a private schema and Redis database, with a leased and a
// transactional handler whose runs are counted.
type mwFixture struct {
	ledger  *idempotency.Ledger
	pool    *pgxpool.Pool
	locker  *lock.Locker
	rdb     *redis.Client // the locks'
	worker  *asynqmw.Worker
	charge  asynq.Handler // leased
	debit   asynq.Handler // transactional
	runs    atomic.Int64
	chargeF func(ctx context.Context, c tasks.Charge) (json.RawMessage, error)
}

func newMW(t *testing.T, lease time.Duration, wcfg *asynqmw.Config) *mwFixture {
	t.Helper()
	f := &mwFixture{}
	f.ledger, f.pool = newLedger(t, &idempotency.Config{Lease: lease})
	f.rdb = testenv.Redis(t)
	f.locker = lock.New(f.rdb, nil)
	f.worker = asynqmw.NewWorker(f.ledger, f.locker, wcfg)
	f.chargeF = func(ctx context.Context, c tasks.Charge) (json.RawMessage, error) {
		return json.RawMessage(`{"charge":"` + c.OrderID + `"}`), nil
	}
	f.charge = asynqmw.Leased(f.worker, tasks.TypeCharge, tasks.DecodeCharge, func(ctx context.Context, c tasks.Charge) (json.RawMessage, error) {
		f.runs.Add(1)
		return f.chargeF(ctx, c)
	})
	f.debit = asynqmw.Transactional(f.worker, tasks.TypeDebit, tasks.DecodeDebit, func(ctx context.Context, tx pgx.Tx, d tasks.Debit) (json.RawMessage, error) {
		f.runs.Add(1)
		var one int
		if err := tx.QueryRow(ctx, `SELECT 1`).Scan(&one); err != nil {
			return nil, err
		}
		return json.RawMessage(`{"debit":"` + d.Reference + `"}`), nil
	})
	return f
}

// serve runs the fixture's charge handler on an asynq server configured by cfg (and
// asynqmw.Configure) until the test ends.
func (f *mwFixture) serve(t *testing.T, rdb *redis.Client, cfg asynq.Config) {
	t.Helper()
	cfg.LogLevel = asynq.FatalLevel
	asynqmw.Configure(&cfg)
	srv := asynq.NewServerFromRedisClient(rdb, cfg)
	mux := asynq.NewServeMux()
	mux.Handle(tasks.TypeCharge, f.charge)
	if err := srv.Start(mux); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
}

func chargeTask(t *testing.T, orderID string, amount int64) *asynq.Task {
	t.Helper()
	task, err := tasks.NewChargeTask(tasks.Charge{OrderID: orderID, CustomerID: "c-1", AmountCents: amount, Currency: "EUR"})
	if err != nil {
		t.Fatal(err)
	}
	return task
}

func TestMiddlewareRunsOnceAndAnswersDuplicates(t *testing.T) {
	t.Parallel()
	f := newMW(t, 5*time.Second, nil)
	ctx := testenv.Context(t, 30*time.Second)
	for range 3 {
		if err := f.charge.ProcessTask(ctx, chargeTask(t, "o-1", 100)); err != nil {
			t.Fatal(err)
		}
	}
	d, _ := tasks.NewDebitTask(tasks.Debit{AccountID: "a", AmountCents: 5, Reference: "r-1"})
	for range 2 {
		if err := f.debit.ProcessTask(ctx, d); err != nil {
			t.Fatal(err)
		}
	}
	if n := f.runs.Load(); n != 2 {
		t.Fatalf("handler ran %d times for 5 deliveries of 2 keys, want 2", n)
	}
	if r := get(t, f.ledger, "charge:o-1"); r.Status != idempotency.StatusCompleted || string(r.Result) != `{"charge": "o-1"}` && !jsonEqual(r.Result, json.RawMessage(`{"charge":"o-1"}`)) {
		t.Fatalf("ledger row %+v", r)
	}
}

func TestMiddlewareRejectsBadInputWithoutLedgerRow(t *testing.T) {
	t.Parallel()
	f := newMW(t, 5*time.Second, nil)
	ctx := testenv.Context(t, 30*time.Second)
	for name, task := range map[string]*asynq.Task{
		"malformed":  asynq.NewTask(tasks.TypeCharge, []byte(`{`)),
		"wrong type": asynq.NewTask(tasks.TypeDebit, []byte(`{}`)),
	} {
		err := f.charge.ProcessTask(ctx, task)
		if !errors.Is(err, asynq.SkipRetry) || !strings.Contains(err.Error(), tasks.TypeCharge) {
			t.Errorf("%s: %v, want SkipRetry naming the task type", name, err)
		}
		if asynqmw.IsFailure(err) == false {
			t.Errorf("%s: a bad payload must count as a failure", name)
		}
	}
	if _, err := f.ledger.Get(ctx, "charge:"); !errors.Is(err, idempotency.ErrNotFound) {
		t.Fatalf("bad payloads left a ledger row: %v", err)
	}
	if f.runs.Load() != 0 {
		t.Fatal("handler ran for a bad payload")
	}
}

func TestMiddlewareMismatchIsPermanent(t *testing.T) {
	t.Parallel()
	f := newMW(t, 5*time.Second, nil)
	ctx := testenv.Context(t, 30*time.Second)
	if err := f.charge.ProcessTask(ctx, chargeTask(t, "o-2", 100)); err != nil {
		t.Fatal(err)
	}
	err := f.charge.ProcessTask(ctx, chargeTask(t, "o-2", 999))
	if !errors.Is(err, asynq.SkipRetry) || !errors.Is(err, idempotency.ErrMismatch) || !strings.Contains(err.Error(), "charge:o-2") {
		t.Fatalf("same key, other amount: %v; want a permanent mismatch naming the key", err)
	}
}

func TestMiddlewareHandlerSkipRetryFailsKeyTerminally(t *testing.T) {
	t.Parallel()
	f := newMW(t, 5*time.Second, nil)
	f.chargeF = func(context.Context, tasks.Charge) (json.RawMessage, error) {
		return nil, errors.New("card declined: " + asynq.SkipRetry.Error() + "") // not wrapped: retryable
	}
	ctx := testenv.Context(t, 30*time.Second)
	err := f.charge.ProcessTask(ctx, chargeTask(t, "o-3", 100))
	if err == nil || errors.Is(err, asynq.SkipRetry) || !asynqmw.IsFailure(err) {
		t.Fatalf("retryable handler error: %v", err)
	}
	if r := get(t, f.ledger, "charge:o-3"); r.Status != idempotency.StatusInProgress || r.LastError == "" {
		t.Fatalf("after a retryable error the row is %s with last_error %q", r.Status, r.LastError)
	}

	f.chargeF = func(context.Context, tasks.Charge) (json.RawMessage, error) {
		return nil, errors.Join(errors.New("card declined"), asynq.SkipRetry)
	}
	err = f.charge.ProcessTask(ctx, chargeTask(t, "o-3", 100))
	if !errors.Is(err, asynq.SkipRetry) {
		t.Fatalf("permanent handler error: %v, want SkipRetry", err)
	}
	if r := get(t, f.ledger, "charge:o-3"); r.Status != idempotency.StatusFailed {
		t.Fatalf("after a permanent error the row is %s, want failed", r.Status)
	}
	before := f.runs.Load()
	err = f.charge.ProcessTask(ctx, chargeTask(t, "o-3", 100))
	if !errors.Is(err, asynq.SkipRetry) || !errors.Is(err, idempotency.ErrFailed) || f.runs.Load() != before {
		t.Fatalf("delivery of a failed key: %v (runs %d→%d); want SkipRetry without running", err, before, f.runs.Load())
	}
}

func TestMiddlewarePanicEndsLease(t *testing.T) {
	t.Parallel()
	f := newMW(t, time.Minute, nil)
	f.chargeF = func(context.Context, tasks.Charge) (json.RawMessage, error) { panic("boom") }
	ctx := testenv.Context(t, 30*time.Second)
	func() {
		defer func() {
			if recover() == nil {
				t.Fatal("the panic did not reach asynq")
			}
		}()
		f.charge.ProcessTask(ctx, chargeTask(t, "o-4", 100))
	}()
	first := get(t, f.ledger, "charge:o-4")
	f.chargeF = func(_ context.Context, c tasks.Charge) (json.RawMessage, error) {
		return json.RawMessage(`{"ok":true}`), nil
	}
	// The lease (a minute) ended at the panic, and the lock was released: the next delivery
	// takes over at once.
	if err := f.charge.ProcessTask(ctx, chargeTask(t, "o-4", 100)); err != nil {
		t.Fatalf("delivery after a panic: %v", err)
	}
	if r := get(t, f.ledger, "charge:o-4"); r.Status != idempotency.StatusCompleted || r.Fence <= first.Fence {
		t.Fatalf("after the panic: status %s fence %d (first %d); want completed by a newer fence", r.Status, r.Fence, first.Fence)
	}
}

func TestMiddlewareBusyIsNotAFailure(t *testing.T) {
	t.Parallel()
	f := newMW(t, 3*time.Second, nil)
	ctx := testenv.Context(t, 30*time.Second)

	// Lock busy: another delivery holds the customer's lock.
	lk, err := f.locker.Obtain(ctx, "customer:c-1", 10*time.Second, nil)
	if err != nil {
		t.Fatal(err)
	}
	err = f.charge.ProcessTask(ctx, chargeTask(t, "o-5", 100))
	if !errors.Is(err, asynqmw.ErrLockBusy) || asynqmw.IsFailure(err) {
		t.Fatalf("lock busy: %v (failure %v); want ErrLockBusy, not a failure", err, asynqmw.IsFailure(err))
	}
	if d := asynqmw.RetryDelay(nil)(0, err, nil); d < 500*time.Millisecond || d > time.Second {
		t.Fatalf("lock busy retry delay %s, want 0.5–1 s", d)
	}
	lk.Release(ctx)

	// Lease busy: another worker claimed the key and is still running.
	task := chargeTask(t, "o-6", 100)
	cr, err := f.ledger.Claim(ctx, idempotency.Request{Key: "charge:o-6", TaskType: tasks.TypeCharge,
		Fingerprint: idempotency.Fingerprint(tasks.TypeCharge, task.Payload())})
	if err != nil || cr.Claim == nil {
		t.Fatalf("claim: %+v %v", cr, err)
	}
	err = f.charge.ProcessTask(ctx, task)
	var busy *idempotency.BusyError
	if !errors.As(err, &busy) || asynqmw.IsFailure(err) || busy.Fence != cr.Claim.Fence {
		t.Fatalf("lease busy: %v; want a *BusyError naming fence %d, not a failure", err, cr.Claim.Fence)
	}
	d := asynqmw.RetryDelay(nil)(0, err, nil)
	if left := time.Until(busy.Until); d < left || d > left+2*time.Second {
		t.Fatalf("lease busy retry delay %s, want about the %s left on the lease", d, left)
	}
	// A task first enqueued just now looks again soon; one enqueued long ago, at half its
	// age, but never after the lease ends.
	fresh := outbox.Spec{Key: "charge:o-6", Type: tasks.TypeCharge, Payload: task.Payload()}.Task("t-fresh", time.Now())
	if d := asynqmw.RetryDelay(nil)(0, err, fresh); d < 250*time.Millisecond || d > 600*time.Millisecond {
		t.Fatalf("lease busy retry delay of a fresh task %s, want 250–500 ms", d)
	}
	old := outbox.Spec{Key: "charge:o-6", Type: tasks.TypeCharge, Payload: task.Payload()}.Task("t-old", time.Now().Add(-time.Hour))
	if d, left := asynqmw.RetryDelay(nil)(0, err, old), time.Until(busy.Until); d < left || d > left+2*time.Second {
		t.Fatalf("lease busy retry delay of an hour-old task %s, want the %s left on the lease", d, left)
	}
	if f.runs.Load() != 0 {
		t.Fatal("handler ran while busy")
	}
}

func TestMiddlewareBusyBudget(t *testing.T) {
	t.Parallel()
	f := newMW(t, 10*time.Second, &asynqmw.Config{BusyBudget: time.Minute})
	ctx := testenv.Context(t, 30*time.Second)
	old := asynq.NewTaskWithHeaders(tasks.TypeCharge, chargeTask(t, "o-7", 1).Payload(),
		map[string]string{idempotency.HeaderFirstEnqueued: time.Now().Add(-time.Hour).UTC().Format(time.RFC3339Nano)})
	noHeader := asynq.NewTask(tasks.TypeCharge, old.Payload())
	if _, err := f.ledger.Claim(ctx, idempotency.Request{Key: "charge:o-7", TaskType: tasks.TypeCharge,
		Fingerprint: idempotency.Fingerprint(tasks.TypeCharge, old.Payload())}); err != nil {
		t.Fatal(err)
	}
	tooLong := func(name string, task *asynq.Task) {
		t.Helper()
		err := f.charge.ProcessTask(ctx, task)
		var tooLong *asynqmw.BusyTooLongError
		if !errors.As(err, &tooLong) || !asynqmw.IsFailure(err) || tooLong.Fence == 0 || tooLong.Owner == "" {
			t.Errorf("%s: %v; want a counted BusyTooLongError naming owner and fence", name, err)
		}
	}
	tooLong("past budget", old)
	// A task without the header (a plain asynq producer's) counts from when the key's
	// generation started: just now, so it is busy, not a failure …
	err := f.charge.ProcessTask(ctx, noHeader)
	var busy *idempotency.BusyError
	if !errors.As(err, &busy) || asynqmw.IsFailure(err) || busy.Age <= 0 || busy.Age > 20*time.Second {
		t.Errorf("no header, key busy for %v: %v; want a busy answer that is not a failure", busy, err)
	}
	// … until the generation is older than the budget.
	testenv.Exec(t, f.pool, `UPDATE processed_jobs SET started_at = now() - interval '1 hour' WHERE idempotency_key = 'charge:o-7'`)
	tooLong("no header, generation an hour old", noHeader)

	// The key's history has the two deliveries busy past the budget, not the bounce
	// between them (written within a second, by the ledger's background write).
	var h []idempotency.HistoryEvent
	for deadline := time.Now().Add(5 * time.Second); len(h) < 2 && time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		if h, err = f.ledger.History(ctx, "charge:o-7"); err != nil {
			t.Fatal(err)
		}
	}
	if len(h) != 2 || h[0].Kind != idempotency.HistoryBusy || h[1].Kind != idempotency.HistoryBusy || h[0].Fence == 0 ||
		!strings.Contains(h[0].Detail, "past the busy budget") {
		t.Fatalf("history of a key busy past its budget twice: %+v; want two busy events naming the holder's fence", h)
	}
}

// A header-less duplicate of a busy key (from a plain asynq producer) waits as busy, with
// no counted failure, and completes as cached once the first delivery completed.
func TestMiddlewareHeaderlessDuplicateOfABusyKey(t *testing.T) {
	t.Parallel()
	f := newMW(t, 10*time.Second, nil)
	rdb := testenv.Redis(t)
	f.serve(t, rdb, asynq.Config{Concurrency: 2, DelayedTaskCheckInterval: 100 * time.Millisecond})
	ctx := testenv.Context(t, time.Minute)
	first := chargeTask(t, "o-plain", 100)
	cr, err := f.ledger.Claim(ctx, idempotency.Request{Key: "charge:o-plain", TaskType: tasks.TypeCharge,
		Fingerprint: idempotency.Fingerprint(tasks.TypeCharge, first.Payload())})
	if err != nil || cr.Claim == nil {
		t.Fatalf("claim: %+v %v", cr, err)
	}
	if _, err := asynq.NewClientFromRedisClient(rdb).Enqueue(asynq.NewTask(tasks.TypeCharge, first.Payload()),
		asynq.Queue(tasks.Queue), asynq.TaskID("plain-dup"), asynq.Retention(time.Hour)); err != nil {
		t.Fatal(err)
	}
	time.Sleep(1500 * time.Millisecond) // the duplicate finds the key busy, perhaps more than once
	if err := f.ledger.Complete(ctx, cr.Claim, json.RawMessage(`{"first":true}`)); err != nil {
		t.Fatal(err)
	}
	insp := asynq.NewInspectorFromRedisClient(rdb)
	for {
		info, err := insp.GetTaskInfo(tasks.Queue, "plain-dup")
		if err == nil && info.State == asynq.TaskStateCompleted {
			if info.Retried != 0 {
				t.Errorf("the duplicate was retried %d times as a failure (last error %q), want none", info.Retried, info.LastErr)
			}
			if got := string(info.Result); !strings.Contains(got, `"first"`) {
				t.Errorf("the duplicate's result %q, want the first delivery's", got)
			}
			break
		}
		if err == nil && info.State == asynq.TaskStateArchived || ctx.Err() != nil {
			t.Fatalf("the duplicate: %+v %v", info, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if f.runs.Load() != 0 {
		t.Error("the handler ran for the duplicate")
	}
}

func TestMiddlewareWithAsynqServer(t *testing.T) {
	t.Parallel()
	f := newMW(t, 800*time.Millisecond, nil)
	rdb := testenv.Redis(t)
	big := strings.Repeat("x", asynqmw.MaxResultWriteBytes)
	f.chargeF = func(_ context.Context, c tasks.Charge) (json.RawMessage, error) {
		if c.OrderID == "big" {
			return json.Marshal(map[string]string{"pad": big})
		}
		return json.RawMessage(`{"charge":"` + c.OrderID + `"}`), nil
	}
	f.serve(t, rdb, asynq.Config{Concurrency: 4, DelayedTaskCheckInterval: 200 * time.Millisecond})
	client := asynq.NewClientFromRedisClient(rdb)
	insp := asynq.NewInspectorFromRedisClient(rdb)
	ctx := testenv.Context(t, time.Minute)

	// A key another worker holds, delivered on its last attempt (MaxRetry 0): the delivery
	// waits for the lease to end instead of archiving the task as busy.
	held := chargeTask(t, "held", 100)
	if _, err := f.ledger.Claim(ctx, idempotency.Request{Key: "charge:held", TaskType: tasks.TypeCharge,
		Fingerprint: idempotency.Fingerprint(tasks.TypeCharge, held.Payload())}); err != nil {
		t.Fatal(err)
	}
	for _, task := range []*asynq.Task{held, chargeTask(t, "small", 100), chargeTask(t, "big", 100)} {
		if _, err := client.Enqueue(task, asynq.MaxRetry(0)); err != nil {
			t.Fatal(err)
		}
	}
	infos := map[string]*asynq.TaskInfo{}
	for len(infos) < 3 && ctx.Err() == nil {
		for _, id := range []string{"charge:held", "charge:small", "charge:big"} {
			if info, err := insp.GetTaskInfo(tasks.Queue, id); err == nil && (info.State == asynq.TaskStateCompleted || info.State == asynq.TaskStateArchived) {
				infos[id] = info
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	for id, info := range infos {
		if info.State != asynq.TaskStateCompleted {
			t.Errorf("%s: state %s (%s), want completed", id, info.State, info.LastErr)
		}
	}
	if got := string(infos["charge:small"].Result); got != `{"charge":"small"}` {
		t.Errorf("small result in asynq = %q", got)
	}
	if n := len(infos["charge:big"].Result); n != 0 {
		t.Errorf("a %d-byte result was written to asynq, want none over %d", n, asynqmw.MaxResultWriteBytes)
	}
	if r := get(t, f.ledger, "charge:big"); len(r.Result) <= asynqmw.MaxResultWriteBytes {
		t.Errorf("the ledger kept %d bytes of the big result", len(r.Result))
	}
	if r := get(t, f.ledger, "charge:held"); r.Status != idempotency.StatusCompleted || r.Attempts != 2 {
		t.Errorf("held key: %s after %d attempts, want completed by the takeover", r.Status, r.Attempts)
	}
}

func TestRetryDelayDefersOtherErrors(t *testing.T) {
	t.Parallel()
	next := func(n int, err error, t *asynq.Task) time.Duration { return time.Duration(n) * time.Hour }
	if d := asynqmw.RetryDelay(next)(3, errors.New("x"), nil); d != 3*time.Hour {
		t.Fatalf("other error: %s, want the next func's 3h", d)
	}
	if !asynqmw.IsFailure(errors.New("x")) || asynqmw.IsFailure(&idempotency.BusyError{Key: "k"}) {
		t.Fatal("IsFailure: an ordinary error must count, a busy key must not")
	}
}

// TestPostgresUnavailableIsRetriedSoon: a delivery that met Postgres unreachable (a
// refused connection, a server shutting down, a standby not yet promoted) is retried within
// 1.5 s and burns no retry; a provider that does not answer is an ordinary failure.
func TestPostgresUnavailableIsRetriedSoon(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, 10*time.Second)
	port := testenv.FreePort(t) // nothing listens there
	_, refused := pgx.Connect(ctx, fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?connect_timeout=2", port))
	_, httpErr := http.Get(fmt.Sprintf("http://127.0.0.1:%d/", port))
	next := func(int, error, *asynq.Task) time.Duration { return time.Hour }
	for _, err := range []error{
		fmt.Errorf("wallet:debit: key debit:1: idempotency: claim debit:1: %w", refused),
		fmt.Errorf("idempotency: commit: %w", &pgconn.PgError{Severity: "FATAL", Code: "57P01", Message: "terminating connection due to unexpected postmaster exit"}),
		fmt.Errorf("idempotency: claim: %w", &pgconn.PgError{Severity: "ERROR", Code: "25006", Message: "cannot execute INSERT in a read-only transaction"}),
	} {
		if err == nil || asynqmw.IsFailure(err) {
			t.Errorf("%v: IsFailure true, want false", err)
		}
		if d := asynqmw.RetryDelay(next)(5, err, nil); d < 500*time.Millisecond || d > 1500*time.Millisecond {
			t.Errorf("%v: retry in %s, want within 0.5-1.5 s", err, d)
		}
	}
	// A lease lost while the handler ran is retried soon too, and counted.
	lost := fmt.Errorf("charge: key charge:1: %w: %w", context.Canceled, fmt.Errorf("%w: key %q fence 3: no heartbeat reached the database", idempotency.ErrLeaseLost, "charge:1"))
	if d := asynqmw.RetryDelay(next)(5, lost, nil); !asynqmw.IsFailure(lost) || d < 500*time.Millisecond || d > 1500*time.Millisecond {
		t.Errorf("%v: IsFailure %v, retry in %s; want a failure retried within 0.5-1.5 s", lost, asynqmw.IsFailure(lost), d)
	}
	if err := fmt.Errorf("charge: %w", httpErr); httpErr == nil || !asynqmw.IsFailure(err) || asynqmw.RetryDelay(next)(5, err, nil) != time.Hour {
		t.Errorf("%v: want an ordinary failure, retried by next", err)
	}
}

// TestMiddlewareDoesNotWriteResultsForLostTasks: when Redis loses a task while its handler
// runs, the result stays in the ledger and no hash without a message is left in Redis.
func TestMiddlewareDoesNotWriteResultsForLostTasks(t *testing.T) {
	t.Parallel()
	rdb := testenv.Redis(t)
	f := newMW(t, 5*time.Second, &asynqmw.Config{Redis: rdb})
	f.chargeF = func(ctx context.Context, c tasks.Charge) (json.RawMessage, error) {
		if c.OrderID == "lost" {
			// Redis loses everything while the handler runs (a restart without persistence).
			if err := rdb.FlushDB(ctx).Err(); err != nil {
				return nil, err
			}
		}
		return json.RawMessage(`{"charge":"` + c.OrderID + `"}`), nil
	}
	f.serve(t, rdb, asynq.Config{Concurrency: 1})
	client := asynq.NewClientFromRedisClient(rdb)
	insp := asynq.NewInspectorFromRedisClient(rdb)
	ctx := testenv.Context(t, 30*time.Second)
	waitCompleted := func(key string) {
		for {
			r, err := f.ledger.Get(ctx, key)
			if err == nil && r.Status == idempotency.StatusCompleted {
				return
			}
			if ctx.Err() != nil {
				t.Fatalf("%s never completed", key)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}

	// A task Redis keeps gets its result written, for the dashboard.
	if _, err := client.Enqueue(chargeTask(t, "kept", 1)); err != nil {
		t.Fatal(err)
	}
	waitCompleted("charge:kept")
	for {
		if info, err := insp.GetTaskInfo(tasks.Queue, "charge:kept"); err == nil && info.State == asynq.TaskStateCompleted {
			if string(info.Result) != `{"charge":"kept"}` {
				t.Fatalf("kept task's result %q", info.Result)
			}
			break
		}
		if ctx.Err() != nil {
			t.Fatal("the kept task never showed completed")
		}
		time.Sleep(20 * time.Millisecond)
	}

	// A task Redis loses mid-handler: completed in the ledger, nothing re-created in Redis.
	if _, err := client.Enqueue(chargeTask(t, "lost", 1)); err != nil {
		t.Fatal(err)
	}
	waitCompleted("charge:lost")
	time.Sleep(200 * time.Millisecond) // asynq's own completion attempt comes after the handler
	fields, err := rdb.HGetAll(ctx, "asynq:{default}:t:charge:lost").Result()
	if err != nil || len(fields) != 0 {
		t.Fatalf("the lost task's hash holds %v (%v); want none (a result-only hash is never cleaned up)", fields, err)
	}
}

// keyJob is a job whose lock scope is its own key.
type keyJob struct {
	ID string `json:"id"`
}

func (j keyJob) Key() string       { return "keyjob:" + j.ID }
func (j keyJob) LockScope() string { return j.Key() }

// TestMiddlewareKeyScopedJobsSkipTheLock: a job scoped to its own key is guarded by the
// ledger alone unless LockKeyScoped asks for the lock; either way it runs once and its
// duplicates are answered from the ledger.
func TestMiddlewareKeyScopedJobsSkipTheLock(t *testing.T) {
	t.Parallel()
	for _, locked := range []bool{false, true} {
		var lockEvents atomic.Int64
		f := newMW(t, 5*time.Second, &asynqmw.Config{
			LockKeyScoped: locked,
			ObserveLock:   func(asynqmw.LockEvent, string) { lockEvents.Add(1) },
		})
		var runs atomic.Int64
		h := asynqmw.Leased(f.worker, "test:keyjob", func(b []byte) (keyJob, error) {
			var j keyJob
			return j, json.Unmarshal(b, &j)
		}, func(ctx context.Context, j keyJob) (json.RawMessage, error) {
			runs.Add(1)
			return json.RawMessage(`{"id":"` + j.ID + `"}`), nil
		})
		ctx := testenv.Context(t, 30*time.Second)
		for range 3 {
			if err := h.ProcessTask(ctx, asynq.NewTask("test:keyjob", []byte(`{"id":"k1"}`))); err != nil {
				t.Fatal(err)
			}
		}
		if n := runs.Load(); n != 1 {
			t.Errorf("LockKeyScoped=%v: ran %d times for 3 deliveries, want 1", locked, n)
		}
		if n := lockEvents.Load(); locked && n != 3 || !locked && n != 0 {
			t.Errorf("LockKeyScoped=%v: %d lock outcomes for 3 deliveries", locked, n)
		}
		if r := get(t, f.ledger, "keyjob:k1"); r.Status != idempotency.StatusCompleted {
			t.Errorf("LockKeyScoped=%v: row %+v", locked, r)
		}
	}
}

// A task whose type no handler serves is archived at once (SkipRetry) with the reason
// naming the known types and the fix; a known one reaches its handler.
func TestArchiveUnknown(t *testing.T) {
	t.Parallel()
	mux := asynq.NewServeMux()
	ran := 0
	mux.HandleFunc(tasks.TypeDebit, func(context.Context, *asynq.Task) error { ran++; return nil })
	h := asynqmw.ArchiveUnknown(mux, tasks.TypeDebit)
	err := h.ProcessTask(context.Background(), asynq.NewTask("foo:bar", nil))
	if !errors.Is(err, asynq.SkipRetry) || !strings.Contains(err.Error(), `unknown task type "foo:bar": this worker handles wallet:debit and archives`) ||
		!strings.Contains(err.Error(), "give other task types a queue of their own") {
		t.Errorf("unknown type: %v; want SkipRetry naming the type and the known ones", err)
	}
	if err := h.ProcessTask(context.Background(), asynq.NewTask(tasks.TypeDebit, nil)); err != nil || ran != 1 {
		t.Errorf("known type: %v, handler ran %d times; want it run once", err, ran)
	}
}
