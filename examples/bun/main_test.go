package main

import (
	"testing"

	"github.com/jackc/pgx/v5/stdlib"
	"github.com/uptrace/bun"
	"github.com/uptrace/bun/dialect/pgdialect"

	"github.com/idemq/idemq/examples/internal/exampletest"
	"github.com/idemq/idemq/idempotency/idempotencytest"
)

// The harness delivers a posting under every schedule (duplicates, crashes before and
// after the effect, a stale owner, an error after the effect, Redis loss, shared commits)
// and wants exactly one row for its reference each time. bun's DB is over the test's own
// pool: the harness's workers hand the handler transactions of their own.
func TestPostingsTakeEffectOnce(t *testing.T) {
	pool, _ := exampletest.Postgres(t)
	sqldb := stdlib.OpenDBFromPool(pool)
	t.Cleanup(func() { sqldb.Close() })
	a := app{db: bun.NewDB(sqldb, pgdialect.New())}
	cfg := idempotencytest.Config{Pool: pool, Redis: exampletest.Redis(t), Handlers: a.register}
	idempotencytest.Run(t, cfg, exampletest.PostingCase(pool))
}
