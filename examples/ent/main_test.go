package main

import (
	"testing"
	"time"

	"entgo.io/ent/dialect"
	entsql "entgo.io/ent/dialect/sql"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/idemq/idemq/examples/ent/ent"
	"github.com/idemq/idemq/examples/internal/exampletest"
	"github.com/idemq/idemq/idempotency/idempotencytest"
)

// The harness delivers a posting under every schedule (duplicates, crashes before and
// after the effect, a stale owner, an error after the effect, Redis loss, shared commits)
// and wants exactly one row for its reference each time.
func TestPostingsTakeEffectOnce(t *testing.T) {
	pool, _ := exampletest.Postgres(t)
	cfg := idempotencytest.Config{Pool: pool, Redis: exampletest.Redis(t), Handlers: register}
	idempotencytest.Run(t, cfg, exampletest.PostingCase(pool))
}

// client.Tx on a driver over a transaction runs in that transaction: its commit leaves it
// open, and its writes go with the outer transaction's end.
func TestClientTxStaysInTheDeliverysTransaction(t *testing.T) {
	ctx := exampletest.Context(t, time.Minute)
	pool, _ := exampletest.Postgres(t)
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	client := ent.NewClient(ent.Driver(onTx{entsql.NewDriver(dialect.Postgres, entsql.Conn{ExecQuerier: tx})}))
	etx, err := client.Tx(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := etx.Posting.Create().SetAccount("a").SetCents(1).SetRef("r").Save(ctx); err != nil {
		t.Fatal(err)
	}
	if err := etx.Commit(); err != nil {
		t.Fatal(err)
	}
	var n int
	if err := tx.QueryRowContext(ctx, `SELECT count(*) FROM postings`).Scan(&n); err != nil || n != 1 {
		t.Fatalf("in the transaction after ent's commit: %d rows, %v; want it open, with the row", n, err)
	}
	if err := tx.Rollback(); err != nil {
		t.Fatal(err)
	}
	if n, err := exampletest.Count(ctx, pool, `SELECT count(*) FROM postings`); err != nil || n != 0 {
		t.Fatalf("after the transaction rolled back: %d rows, %v; want none", n, err)
	}
}
