package store

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
)

// claimManySQL claims a batch of keys in one statement, for leased work: $1..$5 and $7
// are arrays with one element per key (key, task type, owner, fingerprint or NULL, lease
// in microseconds; trace id or NULL), $6 the maximum age. The lock_timeout is set before
// it, by claimSettingsSQL.
// Every answer row starts with the key's ordinal in the arrays, then the row's columns
// (ClaimRow). A key whose row is completed is answered by a plain read, without locking
// the row or drawing a fence; the upsert re-checks everything on the newest row version
// (ON CONFLICT reads past the snapshot), so when it takes nothing the caller reads again.
// The settings are made once, before any row is locked; the upsert takes its rows in key
// order.
const claimManySQL = `
WITH req AS (
	SELECT * FROM unnest($1::text[], $2::text[], $3::uuid[], $4::bytea[], $5::bigint[], $7::text[]) WITH ORDINALITY
		AS req(key, task_type, owner, fp, lease_us, trace_id, ord)
), settings AS (
	SELECT set_config('synchronous_commit', 'on', true) AS synchronous_commit
), cur AS (
	SELECT req.ord, p.status, p.fence, p.owner, p.payload_sha256, p.result, p.attempts, p.last_error,
	       p.locked_until, p.started_at, p.completed_at, p.generation
	FROM req JOIN processed_jobs p ON p.idempotency_key = req.key
), gate AS (
	SELECT req.*, NOT EXISTS (
	           SELECT 1 FROM cur
	           WHERE cur.ord = req.ord
	             AND NOT (status = 'in_progress' AND locked_until < now()
	                      AND started_at >= now() - $6::bigint * interval '1 microsecond'
	                      AND (payload_sha256 IS NULL OR req.fp IS NULL OR payload_sha256 = req.fp))
	       ) AS open
	FROM req
), up AS (
	INSERT INTO processed_jobs AS p
		(idempotency_key, task_type, status, fence, owner, payload_sha256, attempts, locked_until, completed_at, trace_id)
	SELECT gate.key, gate.task_type, 'in_progress',
	       nextval('processed_jobs_fence_seq'), gate.owner, gate.fp, 1,
	       now() + gate.lease_us * interval '1 microsecond', NULL, gate.trace_id
	FROM settings, gate WHERE gate.open
	ORDER BY gate.key
	ON CONFLICT (idempotency_key) DO UPDATE
	SET status = excluded.status, fence = excluded.fence, owner = excluded.owner, attempts = p.attempts + 1,
	    locked_until = excluded.locked_until, completed_at = excluded.completed_at, updated_at = now(),
	    trace_id = excluded.trace_id, payload_sha256 = coalesce(p.payload_sha256, excluded.payload_sha256)
	WHERE p.status = 'in_progress' AND p.locked_until < now()
	  AND p.started_at >= now() - $6::bigint * interval '1 microsecond'
	  AND (p.payload_sha256 IS NULL OR excluded.payload_sha256 IS NULL
	       OR p.payload_sha256 = excluded.payload_sha256)
	RETURNING p.idempotency_key, p.status, p.fence, p.owner, p.payload_sha256, p.result, p.attempts, p.last_error,
	          p.locked_until, p.started_at, p.completed_at, p.generation
), restored AS (
	-- The settings claimSettingsSQL made, put back once every row of up is written (the
	-- count reads them all, whatever the plan): a DoTx handler's own queries plan and
	-- wait as they would without the ledger.
	SELECT ` + restoreSettings + ` FROM (SELECT count(*) FROM up) written
)
SELECT req.ord, true, true, up.status, up.fence, up.owner, up.payload_sha256, up.result, up.attempts, up.last_error,
       up.locked_until, up.started_at, up.completed_at, up.generation, now(), NULL::text,
       pg_postmaster_start_time()::text, (SELECT cur.fence FROM cur WHERE cur.ord = req.ord)
FROM restored, up JOIN req ON req.key = up.idempotency_key
UNION ALL
SELECT gate.ord, false, gate.open, cur.status, cur.fence, cur.owner, cur.payload_sha256, cur.result, cur.attempts,
       cur.last_error, cur.locked_until, cur.started_at, cur.completed_at, cur.generation, now(), NULL, NULL, NULL
FROM restored, gate LEFT JOIN cur ON cur.ord = gate.ord
WHERE NOT EXISTS (SELECT 1 FROM up WHERE up.idempotency_key = gate.key)`

// ClaimMany is the claim statement.
var ClaimMany = &Statement{Name: "idemq_claim_many", SQL: claimManySQL}

// ClaimArgs returns ClaimMany's arguments for ps.
func ClaimArgs(ps []ClaimParams, maxAge time.Duration) []any {
	keys, types := make([]string, len(ps)), make([]string, len(ps))
	owners, fps, leases := make([]pgtype.UUID, len(ps)), make([][]byte, len(ps)), make([]int64, len(ps))
	traces := make([]pgtype.Text, len(ps))
	for i, p := range ps {
		keys[i], types[i], owners[i], fps[i], leases[i] = p.Key, p.TaskType, p.Owner, p.Fingerprint, p.Lease.Microseconds()
		traces[i] = pgtype.Text{String: p.TraceID, Valid: p.TraceID != ""}
	}
	return []any{keys, types, owners, fps, leases, maxAge.Microseconds(), traces}
}

// ScanClaim reads an answered row of ClaimMany (in a Round: its ordinal is read) into r.
func ScanClaim(rows pgx.Rows, r *ClaimRow) error { return rows.Scan(r.targets(nil)...) }

// readRowSQL reads a row for a claim that lost a race, in the shape of ClaimMany's rows.
const readRowSQL = `
SELECT false, false, status, fence, owner, payload_sha256, result, attempts, last_error,
       locked_until, started_at, completed_at, generation, now(), NULL::text, NULL::text, NULL::bigint
FROM processed_jobs WHERE idempotency_key = $1`

// markStuckOneSQL turns one expired, too old in-progress claim into needs_attention.
const markStuckOneSQL = `
UPDATE processed_jobs SET status = 'needs_attention', updated_at = now()
WHERE idempotency_key = $1 AND fence = $2 AND status = 'in_progress' AND locked_until < now()`

// ReadRow reads key's row for a claim that lost a race, with a fresh snapshot. A row
// that is gone reads as none (Status not valid).
func ReadRow(ctx context.Context, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, key string, r *ClaimRow) error {
	err := q.QueryRow(ctx, readRowSQL, key).Scan(r.targets()...)
	if err == pgx.ErrNoRows {
		*r = ClaimRow{}
		return nil
	}
	return err
}

// MarkStuckOne turns key's claim fence, expired and too old, into needs_attention.
func MarkStuckOne(ctx context.Context, q interface {
	Exec(context.Context, string, ...any) (pgconn.CommandTag, error)
}, key string, fence int64) error {
	_, err := q.Exec(ctx, markStuckOneSQL, key, fence)
	return err
}

// The multi-row statements join arrays of keys to processed_jobs and job_intents. A plan
// made while a table was small (after a deploy, a purge or a TRUNCATE) may join by
// scanning the whole table, and a connection keeps a prepared statement's plan as the
// table grows: at 50,000 rows the leased stack fell to a fifth of its speed. So these
// statements are planned with sequential scans, hash and merge joins off (keyPlansSQL,
// for the rest of the transaction; ClaimMany puts the settings back): the joins
// then take the primary keys whatever the tables' sizes, and the plan is made once per
// connection, not once per batch.
const (
	keyPlansSQL = `SELECT set_config('idemq.saved_plans', concat_ws(',', current_setting('enable_seqscan'),
	       current_setting('enable_hashjoin'), current_setting('enable_mergejoin'), current_setting('plan_cache_mode')), true),
	       set_config('enable_seqscan', 'off', true), set_config('enable_hashjoin', 'off', true),
	       set_config('enable_mergejoin', 'off', true), set_config('plan_cache_mode', 'force_generic_plan', true)`
	// claimSettingsSQL is keyPlansSQL plus the bound on the claims' waits for another
	// session's row ($1, as "2000ms"), for the rest of the transaction; ClaimMany puts
	// both back when its rows are written (restoreSettings).
	claimSettingsSQL = keyPlansSQL + `,
	       set_config('idemq.saved_lock_timeout', current_setting('lock_timeout'), true), set_config('lock_timeout', $1, true)`
	restoreSettings = restorePlans + `,
	       set_config('lock_timeout', current_setting('idemq.saved_lock_timeout'), true)`
	restorePlans = `set_config('enable_seqscan', split_part(current_setting('idemq.saved_plans'), ',', 1), true),
	       set_config('enable_hashjoin', split_part(current_setting('idemq.saved_plans'), ',', 2), true),
	       set_config('enable_mergejoin', split_part(current_setting('idemq.saved_plans'), ',', 3), true),
	       set_config('plan_cache_mode', split_part(current_setting('idemq.saved_plans'), ',', 4), true)`
)
