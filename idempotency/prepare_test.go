package idempotency_test

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/idempotency"
	"github.com/idemq/idemq/internal/testenv"
)

// Under pgx's default exec mode the ledger caches named prepared statements per
// connection, as pgx does; a pool whose URL asks for a mode without a statement cache
// (what a transaction-mode pooler needs) leaves no prepared statement on its connections,
// through group commit and without it.
func TestLedgerPreparesOnlyWhenThePoolDoes(t *testing.T) {
	t.Parallel()
	base := testenv.PostgresURL(t)
	for _, tc := range []struct {
		mode    string
		prepare bool
	}{{"", true}, {"exec", false}, {"simple_protocol", false}} {
		for _, grouped := range []bool{true, false} {
			url := base + "&pool_max_conns=1"
			if tc.mode != "" {
				url += "&default_query_exec_mode=" + tc.mode
			}
			pool := testenv.Pool(t, url)
			l := idempotency.New(pool, &idempotency.Config{DisableGroupCommit: !grouped})
			ctx := testenv.Context(t, 30*time.Second)
			for i := range 3 {
				key := fmt.Sprintf("prep-%s-%t-%d", tc.mode, grouped, i)
				if _, err := l.Do(ctx, req(key), func(context.Context) (json.RawMessage, error) { return json.RawMessage(`1`), nil }); err != nil {
					t.Fatalf("mode %q grouped %t: %v", tc.mode, grouped, err)
				}
			}
			var named []string
			rows, err := pool.Query(ctx, `SELECT name FROM pg_prepared_statements WHERE name LIKE 'idemq%'`, pgx.QueryExecModeSimpleProtocol)
			if err == nil {
				named, err = pgx.CollectRows(rows, pgx.RowTo[string])
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := len(named) > 0; got != tc.prepare {
				t.Errorf("mode %q grouped %t: idemq's prepared statements %v, want some: %t", tc.mode, grouped, named, tc.prepare)
			}
			l.Close()
		}
	}
}
