// Package testledger gives a test a Ledger on a fresh migrated schema of its own.
package testledger

import (
	"context"
	"encoding/json"
	"fmt"
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

// Get returns key's ledger row, failing the test when there is none.
func Get(t testing.TB, l *idempotency.Ledger, key string) *idempotency.Record {
	t.Helper()
	r, err := l.Get(context.Background(), key)
	if err != nil {
		t.Fatalf("Get(%q): %v", key, err)
	}
	return r
}

// JSONEqual reports whether a and b print as the same JSON value, whatever their spacing
// and key order.
func JSONEqual(a, b json.RawMessage) bool {
	var x, y any
	if json.Unmarshal(a, &x) != nil || json.Unmarshal(b, &y) != nil {
		return false
	}
	return fmt.Sprint(x) == fmt.Sprint(y)
}
