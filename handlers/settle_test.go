package handlers_test

import (
	"context"
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/handlers"
	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/idempotency/schedule"
	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/tasks"
)

// TestSettleWaitsForItsPeriodToEnd: a settlement whose tick the database's clock has not
// reached (a job enqueued early) settles nothing and is retried, so that the entries of
// the period's last seconds are in it when it runs; once the period has ended, it sums
// them.
func TestSettleWaitsForItsPeriodToEnd(t *testing.T) {
	t.Parallel()
	pool := testenv.Postgres(t)
	ledger := idempotency.New(pool, nil)
	defer ledger.Close()
	ctx := testenv.Context(t, 30*time.Second)
	var dbNow time.Time
	if err := pool.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&dbNow); err != nil {
		t.Fatal(err)
	}
	s := tasks.Settle{Tick: schedule.Tick{Entry: "settle", At: dbNow.UTC().Truncate(time.Second).Add(2 * time.Second)}, Period: "1m"}
	settle := func() (idempotency.Result, error) {
		return ledger.DoTx(ctx, idempotency.Request{Key: s.Key(), TaskType: tasks.TypeSettle},
			func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) { return handlers.Settle(ctx, tx, s) })
	}
	if _, err := settle(); err == nil || errors.Is(err, asynq.SkipRetry) {
		t.Fatalf("a settlement 2 s before its period ends: %v, want an error to retry", err)
	}
	if n := testenv.Count(t, pool, `SELECT count(*) FROM wallet_settlements`); n != 0 {
		t.Fatalf("%d settlements written before the period ended", n)
	}
	// An entry of the period's last second, then the period ends.
	testenv.Exec(t, pool, `INSERT INTO wallet_entries (account_id, amount_cents, reference, fence, created_at) VALUES ('a', 7, 'r', 1, $1)`, s.At.Add(-500*time.Millisecond))
	for {
		var ended bool
		if err := pool.QueryRow(ctx, `SELECT clock_timestamp() >= $1`, s.At).Scan(&ended); err != nil {
			t.Fatal(err)
		}
		if ended {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	res, err := settle()
	if err != nil {
		t.Fatal(err)
	}
	var got handlers.SettleResult
	if err := json.Unmarshal(res.Result, &got); err != nil {
		t.Fatal(err)
	}
	if got.Entries != 1 || got.TotalCents != 7 {
		t.Errorf("the settlement after its period ended: %+v, want the last second's entry", got)
	}
}

// TestSettleTakesLateCommitsIntoTheNextPeriod: an entry stamped within a settled period
// whose transaction commits after the settlement ran is summed by the next settlement of
// the schedule entry, once; nothing is left between two.
func TestSettleTakesLateCommitsIntoTheNextPeriod(t *testing.T) {
	t.Parallel()
	pool := testenv.Postgres(t)
	ledger := idempotency.New(pool, nil)
	defer ledger.Close()
	ctx := testenv.Context(t, 30*time.Second)
	var dbNow time.Time
	if err := pool.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&dbNow); err != nil {
		t.Fatal(err)
	}
	first := dbNow.UTC().Truncate(time.Second).Add(-2 * time.Second)
	settle := func(at time.Time) handlers.SettleResult {
		t.Helper()
		s := tasks.Settle{Tick: schedule.Tick{Entry: "settle", At: at}, Period: "1s"}
		res, err := ledger.DoTx(ctx, idempotency.Request{Key: s.Key(), TaskType: tasks.TypeSettle},
			func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) { return handlers.Settle(ctx, tx, s) })
		if err != nil {
			t.Fatal(err)
		}
		var got handlers.SettleResult
		if err := json.Unmarshal(res.Result, &got); err != nil {
			t.Fatal(err)
		}
		return got
	}
	// A debit's transaction stamps its entry within the first period and commits only
	// after that period was settled.
	late, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer late.Rollback(ctx)
	if _, err := late.Exec(ctx, `INSERT INTO wallet_entries (account_id, amount_cents, reference, fence, created_at) VALUES ('a', 5, 'late', 1, $1)`, first.Add(-300*time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	testenv.Exec(t, pool, `INSERT INTO wallet_entries (account_id, amount_cents, reference, fence, created_at) VALUES ('a', 3, 'on-time', 1, $1)`, first.Add(-600*time.Millisecond))
	if got := settle(first); got.Entries != 1 || got.TotalCents != 3 {
		t.Fatalf("first period: %+v, want the entry committed in time", got)
	}
	if err := late.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if got := settle(first.Add(time.Second)); got.Entries != 1 || got.TotalCents != 5 {
		t.Errorf("next period: %+v, want the late commit of the period before", got)
	}
	if got := settle(first.Add(2 * time.Second)); got.Entries != 0 {
		t.Errorf("the period after: %+v, want nothing settled twice", got)
	}
}
