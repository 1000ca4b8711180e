package store_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/idempotency/internal/store"
	"github.com/idemq/idemq/internal/testenv"
)

// beginXact opens a transaction on pool that inserts into t and reads its id.
func beginXact(t *testing.T, pool *pgxpool.Pool, v string) (pgx.Tx, store.XactID) {
	t.Helper()
	ctx := testenv.Context(t, time.Minute)
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tx.Rollback(context.Background()) })
	var id store.XactID
	if err := tx.QueryRow(ctx, store.XactIDSQL).Scan(&id.Xid, &id.ServerStart); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `INSERT INTO t VALUES ($1)`, v); err != nil {
		t.Fatal(err)
	}
	return tx, id
}

func setupXact(t *testing.T) *pgxpool.Pool {
	pool := testenv.Postgres(t)
	testenv.Exec(t, pool, `CREATE TABLE t (v text PRIMARY KEY)`)
	return pool
}

// ResolveXact tells a committed transaction from an aborted one, waits while one is still
// open, and refuses to judge an id from another server run.
func TestResolveXact(t *testing.T) {
	t.Parallel()
	pool := setupXact(t)
	ctx := testenv.Context(t, time.Minute)

	tx, id := beginXact(t, pool, "committed")
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if ok, err := store.ResolveXact(ctx, pool, id); !ok || err != nil {
		t.Fatalf("committed: %v %v", ok, err)
	}
	tx, id = beginXact(t, pool, "aborted")
	tx.Rollback(ctx)
	if ok, err := store.ResolveXact(ctx, pool, id); ok || err != nil {
		t.Fatalf("rolled back: %v %v, want false, nil", ok, err)
	}
	_, id = beginXact(t, pool, "open")
	short, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	if _, err := store.ResolveXact(short, pool, id); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("still open: %v, want the context's deadline", err)
	}
	other := id
	other.ServerStart = "2000-01-01 00:00:00+00"
	if _, err := store.ResolveXact(ctx, pool, other); err == nil {
		t.Fatal("an id of another server run was judged")
	}
}

// A COMMIT that loses its connection (the backend terminated just before) is never
// reported as committed unless it did.
func TestCommitXactOnLostConnection(t *testing.T) {
	t.Parallel()
	pool := setupXact(t)
	ctx := testenv.Context(t, time.Minute)
	tx, id := beginXact(t, pool, "lost")
	var pid int
	if err := tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
		t.Fatal(err)
	}
	testenv.Exec(t, pool, `SELECT pg_terminate_backend($1)`, pid)
	err := store.CommitXact(ctx, tx, pool, id, 2*time.Second)
	if err == nil {
		t.Fatal("a terminated transaction committed")
	}
	if n := testenv.Count(t, pool, `SELECT count(*) FROM t`); n != 0 {
		t.Fatalf("%d rows after a failed commit", n)
	}
}

// A COMMIT cut off by its context while the server works on it (a deferred trigger
// sleeps at commit): whatever CommitXact says matches what the table holds.
func TestCommitXactCutOffAgreesWithTheServer(t *testing.T) {
	t.Parallel()
	pool := setupXact(t)
	testenv.Exec(t, pool, `CREATE FUNCTION slow() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_sleep(0.3); RETURN NULL; END $$`)
	testenv.Exec(t, pool, `CREATE CONSTRAINT TRIGGER slow AFTER INSERT ON t DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION slow()`)
	tx, id := beginXact(t, pool, "slow")
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	err := store.CommitXact(ctx, tx, pool, id, 5*time.Second)
	n := testenv.Count(t, pool, `SELECT count(*) FROM t`)
	switch {
	case errors.Is(err, store.ErrCommitUnknown):
		t.Fatalf("the same server could not say: %v", err)
	case err == nil && n != 1, err != nil && n != 0:
		t.Fatalf("Commit said %v, the table holds %d rows", err, n)
	}
	t.Logf("Commit: %v; rows: %d", err, n)
}
