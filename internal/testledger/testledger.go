// Package testledger gives a test a Ledger on a fresh migrated schema of its own.
package testledger

import (
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/internal/testenv"
)

// New returns a Ledger with cfg on a pool of a fresh migrated schema (testenv.Postgres),
// and the pool; the Ledger is closed when the test ends.
func New(t testing.TB, cfg *idempotency.Config) (*idempotency.Ledger, *pgxpool.Pool) {
	t.Helper()
	pool := testenv.Postgres(t)
	l := idempotency.New(pool, cfg)
	t.Cleanup(l.Close)
	return l, pool
}
