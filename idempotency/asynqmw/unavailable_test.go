package asynqmw_test

import (
	"context"
	"encoding/json"
	"errors"
	"syscall"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/asynqmw"
	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/tasks"
)

// freezePostgres stops a private Postgres with SIGSTOP: the postmaster (its process group:
// no new connection is answered) and the backends of the open connections, which leave
// that group. It returns the backends' pids, for thawPostgres.
func freezePostgres(t *testing.T, ctx context.Context, pg *testenv.PrivatePostgres) []int {
	t.Helper()
	conn, err := pgx.Connect(ctx, pg.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	rows, err := conn.Query(ctx, `SELECT pid FROM pg_stat_activity WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()`)
	if err != nil {
		t.Fatal(err)
	}
	pids, err := pgx.CollectRows(rows, pgx.RowTo[int])
	if err != nil {
		t.Fatal(err)
	}
	if err := pg.Pause(); err != nil {
		t.Fatal(err)
	}
	for _, pid := range pids {
		syscall.Kill(pid, syscall.SIGSTOP) // gone already: nothing to stop
	}
	return pids
}

// thawPostgres resumes what freezePostgres stopped.
func thawPostgres(t *testing.T, pg *testenv.PrivatePostgres, pids []int) {
	t.Helper()
	for _, pid := range pids {
		syscall.Kill(pid, syscall.SIGCONT)
	}
	if err := pg.Resume(); err != nil {
		t.Fatal(err)
	}
}

// TestLedgerWriteTimeoutIsUnavailable: a ledger write that times out because Postgres
// does not answer (a private server and its backends stopped with SIGSTOP) is "Postgres unavailable", like
// a refused connection: retried within 1.5 s and not a failure, until the busy budget from
// the first enqueue ends. A handler's own timeout, and a write cut short by the caller's
// deadline, are not.
func TestLedgerWriteTimeoutIsUnavailable(t *testing.T) {
	t.Parallel()
	pg := testenv.StartPostgres(t)
	ctx := testenv.Context(t, 2*time.Minute)
	if err := testenv.Migrate(ctx, pg.URL); err != nil {
		t.Fatal(err)
	}
	l := idempotency.New(testenv.Pool(t, pg.URL), &idempotency.Config{WriteTimeout: time.Second})
	t.Cleanup(l.Close)
	unavailable, failure := unavailableChecks(t)
	var frozen []int
	pause := func() {
		t.Helper()
		frozen = freezePostgres(t, ctx, pg)
	}
	resume := func() {
		t.Helper()
		thawPostgres(t, pg, frozen)
	}

	// The completion's commit gets no answer within the write timeout.
	_, err := l.Do(ctx, request("complete"), func(context.Context) (json.RawMessage, error) {
		pause()
		return json.RawMessage(`{"ok":true}`), nil
	})
	resume()
	unavailable("completion timed out", err)
	// Its outcome is the next attempt's to read: not completed, so the lease still holds.
	if _, err := l.Claim(ctx, request("complete")); !errors.Is(err, idempotency.ErrBusy) {
		t.Errorf("claim after the timed-out completion: %v, want busy until the lease ends", err)
	}

	// A claim that gets no answer.
	pause()
	_, err = l.Claim(ctx, request("claim"))
	unavailable("claim timed out", err)
	// The same claim cut short by the caller's own deadline, before the write timeout.
	cctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	_, err = l.Claim(cctx, request("claim-deadline"))
	cancel()
	resume()
	failure("claim cut by the caller's deadline", err)

	// A handler's own timeout is its failure, recorded as such.
	_, err = l.Do(ctx, request("handler"), func(context.Context) (json.RawMessage, error) {
		return nil, context.DeadlineExceeded
	})
	failure("handler's own timeout", err)

	// Through the middleware: unavailable is retried soon until the busy budget from the
	// first enqueue ends, then it is a counted failure.
	w := asynqmw.NewWorker(l, nil, &asynqmw.Config{BusyBudget: time.Minute})
	h := asynqmw.Leased(w, tasks.TypeCharge, tasks.DecodeCharge, func(context.Context, tasks.Charge) (json.RawMessage, error) {
		return json.RawMessage(`{}`), nil
	})
	payload := chargeTask(t, "o-unavailable", 1).Payload()
	fresh := asynq.NewTaskWithHeaders(tasks.TypeCharge, payload, idempotency.FirstEnqueuedHeader(time.Now()))
	old := asynq.NewTaskWithHeaders(tasks.TypeCharge, payload, idempotency.FirstEnqueuedHeader(time.Now().Add(-time.Hour)))
	pause()
	err = h.ProcessTask(ctx, fresh)
	unavailable("delivery within the budget", err)
	err = h.ProcessTask(ctx, old)
	resume()
	var tooLong *asynqmw.UnavailableTooLongError
	if !errors.As(err, &tooLong) || !asynqmw.IsFailure(err) || retriedSoon(err) {
		t.Errorf("delivery past the budget: %v; want a counted UnavailableTooLongError", err)
	}
}

// TestDoTxWriteTimeoutIsUnavailable: in transactional mode, the ledger's own statements
// (the claim, the result and COMMIT, the resolution of a commit whose answer was lost)
// that time out because Postgres does not answer make the delivery's error "Postgres
// unavailable", as in leased mode. A handler's own timeout (an error it returns, or a
// query of its own cut by its deadline) and the caller's deadline are not.
func TestDoTxWriteTimeoutIsUnavailable(t *testing.T) {
	t.Parallel()
	pg := testenv.StartPostgres(t)
	ctx := testenv.Context(t, 3*time.Minute)
	if err := testenv.Migrate(ctx, pg.URL); err != nil {
		t.Fatal(err)
	}
	pool := testenv.Pool(t, pg.URL)
	if _, err := pool.Exec(ctx, `CREATE TABLE effects (key text PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	l := idempotency.New(pool, &idempotency.Config{WriteTimeout: time.Second, ClaimLockTimeout: 500 * time.Millisecond})
	t.Cleanup(l.Close)
	unavailable, failure := unavailableChecks(t)
	var frozen []int
	pause := func() {
		t.Helper()
		frozen = freezePostgres(t, ctx, pg)
	}
	resume := func() {
		t.Helper()
		thawPostgres(t, pg, frozen)
	}
	effect := func(key string) func(context.Context, pgx.Tx) (json.RawMessage, error) {
		return func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
			_, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1)`, key)
			return json.RawMessage(`{"ok":true}`), err
		}
	}
	// once checks that key, delivered again with Postgres back, has its effect exactly
	// once and is completed.
	once := func(key string) {
		t.Helper()
		for i := 0; ; i++ {
			// The thawed backend may hold the row a moment longer (busy), until it sees
			// that its client is gone or commits.
			_, err := l.DoTx(ctx, request(key), effect(key))
			if err == nil {
				break
			}
			if !errors.Is(err, idempotency.ErrBusy) || i == 50 {
				t.Fatalf("%s again: %v", key, err)
			}
			time.Sleep(100 * time.Millisecond)
		}
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM effects WHERE key = $1`, key).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if r := get(t, l, key); n != 1 || r.Status != idempotency.StatusCompleted {
			t.Errorf("%s: %d effects, status %s; want 1, completed", key, n, r.Status)
		}
	}

	// A claim that gets no answer (on a connection the pool holds, or a new one).
	once("warm")
	pause()
	_, err := l.DoTx(ctx, request("claim"), effect("claim"))
	resume()
	unavailable("claim timed out", err)
	once("claim")

	// The result's store and COMMIT get no answer: the commit is resolved by transaction
	// id within the write timeout, and unresolved it is unavailable.
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	_, err = l.DoTx(cctx, request("commit"), func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
		if _, err := tx.Exec(ctx, `INSERT INTO effects VALUES ('commit')`); err != nil {
			return nil, err
		}
		pause()
		return json.RawMessage(`{"ok":true}`), nil
	})
	if cctx.Err() != nil {
		t.Error("the lost commit's resolution waited for the caller's deadline")
	}
	cancel()
	resume()
	unavailable("commit timed out", err)
	once("commit") // the frozen COMMIT may have landed after the thaw: cached, or run again

	// The same claim cut short by the caller's own deadline, before the write timeout.
	pause()
	cctx, cancel = context.WithTimeout(ctx, 200*time.Millisecond)
	_, err = l.DoTx(cctx, request("claim-deadline"), effect("claim-deadline"))
	cancel()
	resume()
	failure("claim cut by the caller's deadline", err)

	// A handler's own timeout is its failure.
	_, err = l.DoTx(ctx, request("handler"), func(context.Context, pgx.Tx) (json.RawMessage, error) {
		return nil, context.DeadlineExceeded
	})
	failure("handler's own timeout", err)

	// So is a handler's own query that times out in the transaction, even though it is
	// Postgres that does not answer: the handler's error, not the ledger's.
	_, err = l.DoTx(ctx, request("handler-query"), func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
		pause()
		qctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
		defer cancel()
		_, err := tx.Exec(qctx, `INSERT INTO effects VALUES ('handler-query')`)
		return json.RawMessage(`{}`), err
	})
	resume()
	failure("handler's own query timed out", err)

	// Through the middleware: unavailable is retried soon until the busy budget from the
	// first enqueue ends, then it is a counted failure.
	w := asynqmw.NewWorker(l, nil, &asynqmw.Config{BusyBudget: time.Minute})
	h := asynqmw.Transactional(w, tasks.TypeCharge, tasks.DecodeCharge, func(ctx context.Context, tx pgx.Tx, c tasks.Charge) (json.RawMessage, error) {
		_, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1)`, c.OrderID)
		return json.RawMessage(`{}`), err
	})
	payload := chargeTask(t, "o-tx-unavailable", 1).Payload()
	fresh := asynq.NewTaskWithHeaders(tasks.TypeCharge, payload, idempotency.FirstEnqueuedHeader(time.Now()))
	old := asynq.NewTaskWithHeaders(tasks.TypeCharge, payload, idempotency.FirstEnqueuedHeader(time.Now().Add(-time.Hour)))
	pause()
	err = h.ProcessTask(ctx, fresh)
	unavailable("transactional delivery within the budget", err)
	err = h.ProcessTask(ctx, old)
	resume()
	var tooLong *asynqmw.UnavailableTooLongError
	if !errors.As(err, &tooLong) || !asynqmw.IsFailure(err) || retriedSoon(err) {
		t.Errorf("transactional delivery past the budget: %v; want a counted UnavailableTooLongError", err)
	}
	if err := h.ProcessTask(ctx, fresh); err != nil {
		t.Errorf("transactional delivery with Postgres back: %v", err)
	}
}

// unavailableChecks returns two assertions on how asynq treats a delivery's error:
// unavailable (ErrUnavailable, not a failure, retried within 0.5-1.5 s) and failure (an
// ordinary failure, retried by asynq's own delay).
func unavailableChecks(t *testing.T) (unavailable, failure func(what string, err error)) {
	unavailable = func(what string, err error) {
		t.Helper()
		if !errors.Is(err, idempotency.ErrUnavailable) || asynqmw.IsFailure(err) || !retriedSoon(err) {
			t.Errorf("%s: %v (unavailable %t, failure %t); want ErrUnavailable, not a failure, retried within 0.5-1.5 s",
				what, err, errors.Is(err, idempotency.ErrUnavailable), asynqmw.IsFailure(err))
		}
	}
	failure = func(what string, err error) {
		t.Helper()
		if err == nil || errors.Is(err, idempotency.ErrUnavailable) || !asynqmw.IsFailure(err) || retriedSoon(err) {
			t.Errorf("%s: %v; want an ordinary failure, retried by next", what, err)
		}
	}
	return unavailable, failure
}

// retriedSoon reports whether asynqmw.RetryDelay retries err within 0.5-1.5 s (asynq's own
// delay, for anything else, is an hour here).
func retriedSoon(err error) bool {
	next := func(int, error, *asynq.Task) time.Duration { return time.Hour }
	d := asynqmw.RetryDelay(next)(5, err, nil)
	return d >= 500*time.Millisecond && d <= 1500*time.Millisecond
}

// request is a ledger request of the tests' task type for key.
func request(key string) idempotency.Request {
	return idempotency.Request{Key: key, TaskType: "test:task", Fingerprint: idempotency.Fingerprint("test:task", []byte(key))}
}
