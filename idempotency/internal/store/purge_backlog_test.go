package store_test

import (
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/idempotency/internal/store"
	"github.com/idemq/idemq/internal/testenv"
)

// The purge's backlog is counted from the indexes the purge reads (the started_at index,
// job_intents_dead_idx), as the purge counts it: terminal rows and dead intents without a
// row past the window, not open rows, rows inside it, or a dead intent whose key has a
// row; and each table's count stops at the cap.
func TestPurgeBacklogCountsFromThePurgesIndexes(t *testing.T) {
	t.Parallel()
	pool := testenv.Postgres(t)
	ctx := testenv.Context(t, time.Minute)
	testenv.Exec(t, pool, `INSERT INTO processed_jobs (idempotency_key, task_type, status, fence, attempts, locked_until, owner, started_at, completed_at)
		SELECT 'k' || i, 't', CASE WHEN i % 100 = 0 THEN 'in_progress' ELSE 'completed' END, i, 1, now() - interval '1 day', gen_random_uuid(),
		       now() - CASE WHEN i <= 300 THEN interval '3 days' ELSE interval '1 hour' END, CASE WHEN i % 100 = 0 THEN NULL ELSE now() - interval '2 days' END
		FROM generate_series(1, 5000) i`)
	testenv.Exec(t, pool, `INSERT INTO job_intents (idempotency_key, task_type, payload, payload_sha256, queue, max_retry,
			timeout_ms, retention_ms, state, published_at, finished_at, last_error)
		SELECT k, 't', '\x00', sha256('\x00'), 'default', 0, 0, 0, 'dead', now() - interval '3 days', f, 'invalid payload'
		FROM (VALUES ('dead-1', now() - interval '2 days'), ('dead-2', now() - interval '2 days'), ('dead-new', now()),
		             ('k1', now() - interval '2 days')) AS v(k, f)`)
	testenv.Exec(t, pool, `ANALYZE processed_jobs`)
	testenv.Exec(t, pool, `ANALYZE job_intents`)
	window := int64(24 * time.Hour / time.Microsecond)
	for _, tc := range []struct {
		limit int
		want  int64
	}{
		{1_000_000, 297 + 2}, // 300 rows started 3 days ago, less the 3 in progress; 2 dead intents without a row
		{10, 10 + 2},
		{1, 1 + 1},
	} {
		var n int64
		if err := pool.QueryRow(ctx, store.PurgeBacklogSQL, window, tc.limit).Scan(&n); err != nil || n != tc.want {
			t.Errorf("backlog counted up to %d = %d, %v; want %d", tc.limit, n, err, tc.want)
		}
	}
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SET LOCAL enable_seqscan = off`); err != nil {
			return err
		}
		p := plan(ctx, t, tx, `EXPLAIN `+store.PurgeBacklogSQL, window, 1_000_000)
		for _, idx := range []string{"processed_jobs_started_at_idx", "job_intents_dead_idx"} {
			if !strings.Contains(p, idx) {
				t.Errorf("the backlog count does not read %s:\n%s", idx, p)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
