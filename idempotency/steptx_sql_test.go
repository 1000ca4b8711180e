package idempotency_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/internal/testenv"
)

// StepSQLTx records a step with its database/sql effect in one transaction: a later
// delivery gets the recorded result without running fn, a stale owner's StepSQLTx is
// refused and rolled back, and fn's error rolls its effect back with nothing recorded.
func TestStepSQLTx(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	l, db := sqlLedger(t, &idempotency.Config{Lease: time.Hour})
	var ran atomic.Int64
	record := func(who string) func(ctx context.Context, tx *sql.Tx) (string, error) {
		return func(ctx context.Context, tx *sql.Tx) (string, error) {
			ran.Add(1)
			_, err := tx.ExecContext(ctx, `INSERT INTO effects (key) VALUES ($1)`, who)
			return "recorded by " + who, err
		}
	}

	// fn fails: nothing recorded, its effect rolled back; the delivery's retry runs it.
	_, err := l.Do(ctx, req("order:1"), func(ctx context.Context) (json.RawMessage, error) {
		return nil, func() error {
			_, err := idempotency.StepSQLTx(ctx, "record", func(ctx context.Context, tx *sql.Tx) (string, error) {
				if _, err := tx.ExecContext(ctx, `INSERT INTO effects (key) VALUES ('failed')`); err != nil {
					return "", err
				}
				return "", errors.New("declined")
			})
			return err
		}()
	})
	if err == nil || err.Error() != "declined" {
		t.Fatalf("a failing StepSQLTx: %v, want declined", err)
	}
	if n := sqlCount(t, db, `SELECT count(*) FROM effects WHERE key = 'failed'`); n != 0 {
		t.Fatal("a failed StepSQLTx's effect committed")
	}

	res, err := l.Do(ctx, req("order:1"), func(ctx context.Context) (json.RawMessage, error) {
		s, err := idempotency.StepSQLTx(ctx, "record", record("first"))
		if err != nil {
			return nil, err
		}
		return json.Marshal(s)
	})
	if err != nil || !jsonEqual(res.Result, json.RawMessage(`"recorded by first"`)) {
		t.Fatalf("Do: %+v, %v", res, err)
	}
	// A delivery that takes an unfinished job over gets its recorded step.
	_, err = l.Do(ctx, req("order:2"), func(ctx context.Context) (json.RawMessage, error) {
		if _, err := idempotency.StepSQLTx(ctx, "record", record("order-2")); err != nil {
			return nil, err
		}
		// The lease lapses and another delivery takes the key over: this one is stale.
		if _, err := db.ExecContext(ctx, `UPDATE processed_jobs SET locked_until = now() - interval '1 second' WHERE idempotency_key = 'order:2'`); err != nil {
			return nil, err
		}
		takeover, err := l.Do(ctx, req("order:2"), func(ctx context.Context) (json.RawMessage, error) {
			s, err := idempotency.StepSQLTx(ctx, "record", func(context.Context, *sql.Tx) (string, error) {
				t.Error("the takeover ran a recorded step")
				return "", nil
			})
			if err != nil {
				return nil, err
			}
			return json.Marshal(s)
		})
		if err != nil || !jsonEqual(takeover.Result, json.RawMessage(`"recorded by order-2"`)) || takeover.Attempts != 2 {
			t.Errorf("takeover: %+v, %v; want the recorded step's result at attempt 2", takeover, err)
		}
		_, err = idempotency.StepSQLTx(ctx, "stale", record("stale"))
		if !errors.Is(err, idempotency.ErrLeaseLost) {
			t.Errorf("stale StepSQLTx: %v, want ErrLeaseLost", err)
		}
		return nil, err
	})
	if !errors.Is(err, idempotency.ErrLeaseLost) {
		t.Errorf("stale Do: %v, want ErrLeaseLost", err)
	}
	if n := sqlCount(t, db, `SELECT count(*) FROM effects WHERE key = 'stale'`); n != 0 {
		t.Error("the stale owner's StepSQLTx committed its effect")
	}
	if n, want := ran.Load(), int64(2); n != want {
		t.Errorf("StepSQLTx's fn ran %d times, want %d", n, want)
	}
	if n := sqlCount(t, db, `SELECT count(*) FROM processed_job_steps WHERE step = 'record'`); n != 2 {
		t.Errorf("%d record steps, want 2 (one per job)", n)
	}
}
