package main

import (
	"testing"

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
