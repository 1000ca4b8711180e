package idempotency_test

import (
	"context"
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/internal/testenv"
)

// newLedger returns a ledger on a fresh schema of its own, and the pool.
func newLedger(t *testing.T, cfg *idempotency.Config) (*idempotency.Ledger, *pgxpool.Pool) {
	t.Helper()
	pool := testenv.Postgres(t)
	l := idempotency.New(pool, cfg)
	t.Cleanup(l.Close)
	return l, pool
}

func req(key string) idempotency.Request {
	return idempotency.Request{Key: key, TaskType: "test:task", Fingerprint: idempotency.Fingerprint("test:task", []byte(`{"k":"`+key+`"}`))}
}

func TestSmoke(t *testing.T) {
	t.Parallel()
	ctx := testenv.Context(t, time.Minute)
	l, pool := newLedger(t, nil)
	if _, err := pool.Exec(ctx, `CREATE TABLE effects (key text, n int)`); err != nil {
		t.Fatal(err)
	}
	res, err := l.DoTx(ctx, req("a"), func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
		_, err := tx.Exec(ctx, `INSERT INTO effects VALUES ('a', 1)`)
		return json.RawMessage(`{"x":1}`), err
	})
	t.Logf("%+v %v", res, err)
	res, err = l.DoTx(ctx, req("a"), func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
		t.Fatal("ran twice")
		return nil, nil
	})
	t.Logf("%+v %v", res, err)
	res, err = l.Do(ctx, req("b"), func(ctx context.Context) (json.RawMessage, error) {
		return json.RawMessage(`{"y":2}`), nil
	})
	t.Logf("%+v %v", res, err)
	res, err = l.Do(ctx, req("b"), func(ctx context.Context) (json.RawMessage, error) {
		return nil, errors.New("ran twice")
	})
	t.Logf("%+v %v", res, err)
	r, err := l.Get(ctx, "a")
	t.Logf("%+v %v", r, err)
}
