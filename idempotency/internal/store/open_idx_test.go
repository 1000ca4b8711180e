package store_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/idempotency/internal/store"
	"github.com/idemq/idemq/internal/testenv"
)

// The stuck-row sweep and the count of rows needing attention read the open rows from
// processed_jobs_open_idx, not from a scan of every row the ledger keeps: checked on
// their plans, the count's as a cached statement is after many executions. Sequential
// scans are off, as on a big table, where they lose; the started_at index, which holds
// every row, must lose too.
func TestOpenRowsAreReadFromTheirIndex(t *testing.T) {
	t.Parallel()
	pool := testenv.Postgres(t)
	ctx := testenv.Context(t, time.Minute)
	testenv.Exec(t, pool, `INSERT INTO processed_jobs (idempotency_key, task_type, status, fence, attempts, locked_until, owner, started_at, completed_at)
		SELECT 'k' || i, 't', CASE WHEN i % 100 = 0 THEN 'in_progress' ELSE 'completed' END, i, 1, now() - interval '1 day', gen_random_uuid(),
		       now() - interval '2 days', CASE WHEN i % 100 = 0 THEN NULL ELSE now() END
		FROM generate_series(1, 5000) i`)
	testenv.Exec(t, pool, `ANALYZE processed_jobs`)
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SET LOCAL enable_seqscan = off`); err != nil {
			return err
		}
		sweep := plan(ctx, t, tx, `EXPLAIN `+store.MarkStuckSQL, int64(24*time.Hour/time.Microsecond))
		if _, err := tx.Exec(ctx, `PREPARE count_status AS `+store.CountSQL); err != nil {
			return err
		}
		for range 8 { // past the five custom plans before a generic one is considered
			if _, err := tx.Exec(ctx, `EXECUTE count_status('needs_attention')`); err != nil {
				return err
			}
		}
		count := plan(ctx, t, tx, `EXPLAIN EXECUTE count_status('needs_attention')`)
		for name, p := range map[string]string{"the stuck-row sweep": sweep, "the needs-attention count": count} {
			if !strings.Contains(p, "processed_jobs_open_idx") {
				t.Errorf("%s does not read processed_jobs_open_idx:\n%s", name, p)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	tag, err := pool.Exec(ctx, store.MarkStuckSQL, int64(24*time.Hour/time.Microsecond))
	if err != nil || tag.RowsAffected() != 50 {
		t.Fatalf("the sweep: %v, %v; want the 50 open rows older than a day", tag, err)
	}
}

// plan is query's EXPLAIN output, one line after another.
func plan(ctx context.Context, t *testing.T, tx pgx.Tx, query string, args ...any) string {
	t.Helper()
	rows, err := tx.Query(ctx, query, args...)
	if err != nil {
		t.Fatal(err)
	}
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return strings.Join(lines, "\n")
}
