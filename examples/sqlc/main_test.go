package main

import (
	"context"
	"testing"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/idemq/idemq/examples/internal/exampletest"
	"github.com/idemq/idemq/examples/internal/posting"
	"github.com/idemq/idemq/examples/sqlc/postings"
	"github.com/idemq/idemq/idempotency/idempotencytest"
)

// The harness delivers a posting under every schedule (duplicates, crashes before and
// after the effect, a stale owner, an error after the effect, Redis loss, shared commits)
// and wants exactly one row for its reference each time; the rows are counted with the
// generated CountPostingsByRef, on a *sql.DB of the test's own.
func TestPostingsTakeEffectOnce(t *testing.T) {
	pool, _ := exampletest.Postgres(t)
	db := stdlib.OpenDBFromPool(pool)
	t.Cleanup(func() { db.Close() })
	queries := postings.New(db)
	cfg := idempotencytest.Config{Pool: pool, Redis: exampletest.Redis(t), Handlers: register}
	idempotencytest.Run(t, cfg, idempotencytest.Case{
		Name: "posting",
		Task: func(id string) (*asynq.Task, error) {
			return posting.NewTask(posting.Posting{Account: "acct-" + id, Cents: 250, Ref: "ref-" + id})
		},
		Effects: func(ctx context.Context, id string) (int, error) {
			n, err := queries.CountPostingsByRef(ctx, "ref-"+id)
			return int(n), err
		},
	})
}
