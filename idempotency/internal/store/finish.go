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

// finishTxManySQL ends the rows of a shared DoTx transaction, which claimManySQL wrote
// completed ($1..$7: key, fence, owner, action, error, result, intent sum): 'complete' keeps the row (its
// result is already stored, fenced, by storeResultTxSQL), 'store' stores its result
// ($6, as jsonb: a value jsonb refuses fails the statement), 'fail' records a permanent
// failure, 'forget' undoes the claim of a handler that failed (the row it inserted is
// deleted; a taken-over one is back in progress, its lease ended). Completions and
// failures settle the outbox intents of their own tasks. Every row still held comes back
// with its ordinal and the transaction id.
func finishTxManySQL(f fenceChecks) string {
	return `
WITH r AS (
	SELECT * FROM unnest($1::text[], $2::bigint[], $3::uuid[], $4::text[], $5::text[], $6::text[], $7::bytea[]) WITH ORDINALITY
		AS r(key, fence, owner, action, error, result, intent_sum, ord)
), k AS (
	SELECT r.ord, r.key, r.action FROM r JOIN processed_jobs p
	  ON p.idempotency_key = r.key AND ` + f.rows + ` AND p.status = 'completed'
	WHERE r.action = 'complete'
), s AS (
	UPDATE processed_jobs p SET result = r.result::jsonb, last_error = coalesce(r.error, p.last_error)
	FROM r
	WHERE r.action = 'store' AND p.idempotency_key = r.key AND ` + f.rows + ` AND p.status = 'completed'
	RETURNING r.ord, r.key, 'complete'::text AS action
), f AS (
	UPDATE processed_jobs p SET status = 'failed', last_error = r.error, updated_at = now()
	FROM r
	WHERE r.action = 'fail' AND p.idempotency_key = r.key AND ` + f.rows + ` AND p.status = 'completed'
	RETURNING r.ord, r.key, r.action
), g AS (
	UPDATE processed_jobs p SET status = 'in_progress', completed_at = NULL, locked_until = now(), updated_at = now()
	FROM r
	WHERE r.action = 'forget' AND NOT (p.attempts = 1 AND p.generation = 0)
	  AND p.idempotency_key = r.key AND ` + f.rows + ` AND p.status = 'completed'
	RETURNING r.ord
), d AS (
	DELETE FROM processed_jobs p USING r
	WHERE r.action = 'forget' AND p.attempts = 1 AND p.generation = 0
	  AND p.idempotency_key = r.key AND ` + f.rows + ` AND p.status = 'completed'
	RETURNING r.ord
), i AS (
	UPDATE job_intents j SET finished_at = now(), updated_at = now(),
	       state = CASE WHEN x.action = 'complete' THEN 'done' ELSE 'dead' END,
	       last_error = CASE WHEN x.action = 'complete' THEN j.last_error ELSE r.error END
	FROM (SELECT ord, key, action FROM k UNION ALL SELECT ord, key, action FROM s UNION ALL SELECT ord, key, action FROM f) x
	     JOIN r ON r.ord = x.ord
	WHERE j.idempotency_key = x.key AND j.state IN ('pending', 'published') AND ` + intentOwn + `
), held AS (
	-- Every completed or failed row must still be ours; if not, the statement fails
	-- (division by zero) and the COMMIT sent after it cannot commit.
	SELECT 1 / (CASE WHEN (SELECT count(*) FROM k) + (SELECT count(*) FROM s) + (SELECT count(*) FROM f)
	                    = (SELECT count(*) FROM r WHERE action IN ('complete', 'store', 'fail')) THEN 1 ELSE 0 END) AS ok
)
SELECT ord, ` + xidColumns + ` FROM held, (SELECT ord FROM k UNION ALL SELECT ord FROM s UNION ALL SELECT ord FROM f
                                   UNION ALL SELECT ord FROM g UNION ALL SELECT ord FROM d) e`
}

// storeResultTxSQL stores a DoTx result ($4, NULL for none; $5 the error marker's
// text) on the row the claim wrote completed, and settles the key's outbox intent when
// the delivery was of its own task ($6, the intent sum: see FinishParams.IntentSum). The
// division fails (SQLSTATE 22012) when the fenced update matched no row, which aborts
// the transaction, so the COMMIT pipelined after it cannot commit the effect without its
// completion. Only result and last_error change, which are not indexed: a HOT update.
func storeResultTxSQL(f fenceChecks) string {
	return `
WITH u AS (
	UPDATE processed_jobs SET result = $4, last_error = coalesce($5, last_error)
	WHERE idempotency_key = $1 AND ` + f.args + ` AND status = 'completed'
	RETURNING 1
), i AS (
	UPDATE job_intents j SET finished_at = now(), updated_at = now(), state = 'done'
	FROM (SELECT $6::bytea AS intent_sum) r
	WHERE j.idempotency_key = $1 AND j.state IN ('pending', 'published') AND EXISTS (SELECT 1 FROM u)
	  AND ` + intentOwn + `
)
SELECT 1 / count(*) FROM u`
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

// finishTxArgs returns FinishTxMany's arguments for ps.
func finishTxArgs(ps []FinishParams) []any {
	a := FinishArgs(ps)
	return []any{a[0], a[1], a[2], a[3], a[5], a[4], a[6]}
}

// ScanFinished reads an answered row of FinishMany (in a Round: its ordinal is read).
func ScanFinished(rows pgx.Rows, f *Finished) error {
	return rows.Scan(nil, &f.XID, &f.ServerStart, nil)
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
