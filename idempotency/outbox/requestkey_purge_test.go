package outbox_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/idempotency/outbox"
	"github.com/idemq/idemq/internal/testenv"
)

// planningExec answers PurgeRequestKeys's statements and keeps, for each, how many rows
// it deleted and its plan, read with sequential scans off (as on a big table, where they
// lose).
type planningExec struct {
	pool    *pgxpool.Pool
	deleted []int64
	plans   []string
}

func (p *planningExec) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	err := pgx.BeginFunc(ctx, p.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SET LOCAL enable_seqscan = off`); err != nil {
			return err
		}
		rows, err := tx.Query(ctx, `EXPLAIN `+sql, args...)
		if err != nil {
			return err
		}
		lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
		p.plans = append(p.plans, strings.Join(lines, "\n"))
		return err
	})
	if err != nil {
		return pgconn.CommandTag{}, err
	}
	tag, err := p.pool.Exec(ctx, sql, args...)
	p.deleted = append(p.deleted, tag.RowsAffected())
	return tag, err
}

// PurgeRequestKeys deletes old request keys in statements of at most 1,000 rows, each
// its own transaction, read from the created_at index; it keeps the newer ones.
func TestPurgeRequestKeysInBoundedBatchesFromTheIndex(t *testing.T) {
	t.Parallel()
	pool := testenv.Postgres(t)
	ctx := testenv.Context(t, 30*time.Second)
	mustExec(t, pool, `INSERT INTO api_idempotency_keys (route, header_key, fingerprint, job_key, task_type, status_code, response, created_at)
		SELECT 'POST /v1/debits', 'k-' || i, sha256(i::text::bytea), 'debit:' || i, 'debit', 202, '{}',
		       now() - CASE WHEN i <= 2500 THEN interval '2 hours' ELSE interval '1 minute' END
		FROM generate_series(1, 2600) i`)
	mustExec(t, pool, `ANALYZE api_idempotency_keys`)
	p := &planningExec{pool: pool}
	n, err := outbox.PurgeRequestKeys(ctx, p, time.Hour)
	if err != nil || n != 2500 {
		t.Fatalf("PurgeRequestKeys = %d, %v; want 2500", n, err)
	}
	if got := fmt.Sprint(p.deleted); got != "[1000 1000 500]" {
		t.Errorf("statements deleted %s rows, want [1000 1000 500]", got)
	}
	for _, plan := range p.plans {
		if !strings.Contains(plan, "api_idempotency_keys_created_at_idx") {
			t.Errorf("a purge statement does not read api_idempotency_keys_created_at_idx:\n%s", plan)
		}
	}
	if left := testenv.Count(t, pool, `SELECT count(*) FROM api_idempotency_keys`); left != 100 {
		t.Errorf("%d request keys left, want the 100 newer ones", left)
	}
}
