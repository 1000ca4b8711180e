package store

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
)

// heartbeatSQL extends a claim's lease ($4 µs from now, never shortening it), fenced.
func heartbeatSQL(f fenceChecks) string {
	return `
UPDATE processed_jobs
SET locked_until = greatest(locked_until, now() + $4::bigint * interval '1 microsecond'), updated_at = now()
WHERE idempotency_key = $1 AND ` + f.args + ` AND status = 'in_progress'
RETURNING locked_until`
}

// heartbeatManySQL extends a batch of claims' leases in one statement: $1..$4 are arrays
// with one element per claim (key, fence, owner, lease in µs from now). Each lease is
// extended, never shortened, only if its claim still holds the row; every row that was
// comes back with its ordinal. Rows are locked in the order of the arrays: the caller
// sorts them by key.
func heartbeatManySQL(f fenceChecks) string {
	return `
UPDATE processed_jobs p
SET locked_until = greatest(p.locked_until, now() + r.lease * interval '1 microsecond'), updated_at = now()
FROM unnest($1::text[], $2::bigint[], $3::uuid[], $4::bigint[]) WITH ORDINALITY AS r(key, fence, owner, lease, ord)
WHERE p.idempotency_key = r.key AND ` + f.rows + ` AND p.status = 'in_progress'
RETURNING r.ord`
}

// xidColumns end every finish's answer rows: the transaction id, read before the commit
// is asked for (see Round), and the server's start time; and they turn synchronous_commit
// on for the commit that follows.
const xidColumns = `pg_current_xact_id()::text, pg_postmaster_start_time()::text, set_config('synchronous_commit', 'on', true)`

// intentOwn is the condition on an outbox intent j, joined to a finished row's
// parameters r, under which the finish settles it: the delivery was of the intent's own
// task (r.intent_sum, see FinishParams.IntentSum), or the caller did not say (NULL).
const intentOwn = `(r.intent_sum IS NULL OR j.payload_sha256 = r.intent_sum)`

// finishManySQL ends a batch of claims in one statement: $1..$7 are arrays with one
// element per claim (key, fence, owner, action, result, error, intent sum), where action is
// 'complete' (the row completed with its result), 'retry' (the lease ends at once, the
// row stays in progress) or 'fail' (failed for good). Each row is updated only if its
// claim still holds it; every row that was comes back with its ordinal and the
// transaction id (see Round). Completions
// and permanent failures settle their outbox intents in the same statement, when the
// delivery was of the intent's own task.
func finishManySQL(f fenceChecks) string {
	return `
WITH r AS (
	SELECT * FROM unnest($1::text[], $2::bigint[], $3::uuid[], $4::text[], $5::text[], $6::text[], $7::bytea[]) WITH ORDINALITY
		AS r(key, fence, owner, action, result, error, intent_sum, ord)
), c AS (
	UPDATE processed_jobs p
	SET status = CASE r.action WHEN 'complete' THEN 'completed' WHEN 'fail' THEN 'failed' ELSE p.status END,
	    result = CASE WHEN r.action = 'complete' THEN r.result::jsonb ELSE p.result END,
	    last_error = CASE WHEN r.action = 'complete' THEN coalesce(r.error, p.last_error) ELSE r.error END,
	    completed_at = CASE WHEN r.action = 'retry' THEN p.completed_at ELSE now() END,
	    locked_until = CASE WHEN r.action = 'retry' THEN now() ELSE p.locked_until END,
	    updated_at = now()
	FROM r
	WHERE p.idempotency_key = r.key AND ` + f.rows + ` AND p.status = 'in_progress'
	RETURNING r.ord, p.idempotency_key, p.status, p.last_error
), i AS (
	UPDATE job_intents j SET finished_at = now(), updated_at = now(),
	       state = CASE WHEN c.status = 'completed' THEN 'done' ELSE 'dead' END,
	       last_error = CASE WHEN c.status = 'completed' THEN j.last_error ELSE c.last_error END
	FROM c JOIN r ON r.ord = c.ord
	WHERE j.idempotency_key = c.idempotency_key AND c.status IN ('completed', 'failed')
	  AND j.state IN ('pending', 'published') AND ` + intentOwn + `
)
SELECT c.ord, ` + xidColumns + ` FROM c`
}

// FinishArgs returns FinishMany's arguments for ps.
func FinishArgs(ps []FinishParams) []any {
	keys, fences, owners := make([]string, len(ps)), make([]int64, len(ps)), make([]pgtype.UUID, len(ps))
	actions, results, errs := make([]string, len(ps)), make([]pgtype.Text, len(ps)), make([]pgtype.Text, len(ps))
	sums := make([][]byte, len(ps))
	for i, p := range ps {
		keys[i], fences[i], owners[i], actions[i], results[i], errs[i] = p.Key, p.Fence, p.Owner, string(p.Action), p.Result, p.Error
		sums[i] = p.IntentSum
	}
	return []any{keys, fences, owners, actions, results, errs, sums}
}

// ScanFinished reads an answered row of FinishMany (in a Round: its ordinal is read).
func ScanFinished(rows pgx.Rows, f *Finished) error {
	return rows.Scan(nil, &f.XID, &f.ServerStart, nil)
}

// LeaseParams is one claim's lease to extend (ExtendLeases).
type LeaseParams struct {
	Key   string
	Fence int64
	Owner pgtype.UUID
	Lease time.Duration
}

// ExtendLeases extends the leases of ps in one statement on q, in the order of ps (sort
// them by key). held[i] reports whether ps[i]'s claim still holds its key.
func (w *Writes) ExtendLeases(ctx context.Context, q interface {
	Query(context.Context, string, ...any) (pgx.Rows, error)
}, ps []LeaseParams) (held []bool, err error) {
	keys, fences, owners, leases := make([]string, len(ps)), make([]int64, len(ps)), make([]pgtype.UUID, len(ps)), make([]int64, len(ps))
	for i, p := range ps {
		keys[i], fences[i], owners[i], leases[i] = p.Key, p.Fence, p.Owner, p.Lease.Microseconds()
	}
	rows, err := q.Query(ctx, w.HeartbeatMany, keys, fences, owners, leases)
	if err != nil {
		return nil, err
	}
	held = make([]bool, len(ps))
	var ord int64
	_, err = pgx.ForEachRow(rows, []any{&ord}, func() error {
		held[ord-1] = true
		return nil
	})
	if err != nil {
		return nil, err
	}
	return held, nil
}

// ExtendLease extends a claim's lease by lease from now, never shortening it, on q. It
// reports false when the claim no longer holds the key.
func (w *Writes) ExtendLease(ctx context.Context, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, key string, fence int64, owner pgtype.UUID, lease time.Duration) (until time.Time, held bool, err error) {
	err = q.QueryRow(ctx, w.Heartbeat, key, fence, owner, lease.Microseconds()).Scan(&until)
	if err == pgx.ErrNoRows {
		return time.Time{}, false, nil
	}
	return until, err == nil, err
}
