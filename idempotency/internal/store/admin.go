package store

// The operators' statements (idempotency's Get, List, Release, Rerun, Purge, MarkStuck)
// and the lost-commit resolution.

const RecordColumns = `idempotency_key, task_type, status, fence, owner, generation, payload_sha256,
	result, attempts, last_error, locked_until, created_at, updated_at, started_at, completed_at, trace_id,
	coalesce(locked_until > now(), false)`

const GetSQL = `SELECT ` + RecordColumns + ` FROM processed_jobs WHERE idempotency_key = $1`

// GetManySQL reads the rows of the keys in $1 (text[]).
const GetManySQL = `SELECT ` + RecordColumns + ` FROM processed_jobs WHERE idempotency_key = ANY($1::text[])`

const ListSQL = `SELECT ` + RecordColumns + ` FROM processed_jobs
WHERE $1 = '' OR status = $1 ORDER BY updated_at DESC, idempotency_key LIMIT $2`

// CountSQL counts the rows with status $1 (a scan of the table: no index leads with status).
const CountSQL = `SELECT count(*) FROM processed_jobs WHERE status = $1`

// ReleaseSQL ends a lease and fences its holder out: a new fence and an owner nobody
// holds, so the holder's heartbeat and completion fail with ErrLeaseLost.
const ReleaseSQL = `
UPDATE processed_jobs
SET fence = nextval('processed_jobs_fence_seq'), owner = gen_random_uuid(), locked_until = now(), updated_at = now()
WHERE idempotency_key = $1 AND status = 'in_progress'`

// RerunSQL reopens a terminal row (or an in-progress one whose lease has lapsed and whose
// outbox intent is dead: its task was archived after its retries ran out, so nothing would
// deliver it again) as a new generation whose lease has already ended, so
// the next delivery claims it with a new fence, and, in the same statement, hands the
// key's outbox intent (if it has one) back to the relays for a publish under the next
// TaskID: its publish_generation goes one past the highest the relays and the reconciler
// have used (they record every TaskID they publish under there), so the new task is
// key#r<n> and never collides with a TaskID asynq still holds. The older generations'
// recorded steps are deleted: the new generation runs every step again; their history is
// kept, and a rerun event (worker $3) starts the new generation's. The relays are woken
// (channel $2) when the statement commits. It returns the new generation and the new
// publish generation (NULL without an intent).
const RerunSQL = `
WITH p AS (
	UPDATE processed_jobs
	SET status = 'in_progress', generation = generation + 1, fence = nextval('processed_jobs_fence_seq'),
	    owner = gen_random_uuid(), locked_until = now(), started_at = now(), updated_at = now(),
	    result = NULL, completed_at = NULL, trace_id = NULL
	WHERE idempotency_key = $1 AND (status IN ('completed', 'failed', 'needs_attention')
	      OR status = 'in_progress' AND locked_until < now()
	         AND EXISTS (SELECT FROM job_intents WHERE idempotency_key = $1 AND state = 'dead'))
	RETURNING generation, fence, task_type
), i AS (
	UPDATE job_intents
	SET state = 'pending', publish_generation = publish_generation + 1, relay_until = NULL,
	    last_error = NULL, finished_at = NULL, updated_at = now()
	WHERE idempotency_key = $1 AND EXISTS (SELECT FROM p)
	RETURNING publish_generation
), s AS (
	DELETE FROM processed_job_steps WHERE idempotency_key = $1 AND generation < (SELECT generation FROM p)
), h AS (
	INSERT INTO processed_job_events (idempotency_key, generation, kind, task_type, task_id, worker, fence, detail)
	SELECT $1, p.generation, 'rerun', p.task_type, CASE WHEN i.publish_generation IS NOT NULL THEN $1 || '#r' || i.publish_generation END,
	       $3, p.fence, 'reopened by an operator as generation ' || p.generation
	FROM p LEFT JOIN i ON true
)
SELECT p.generation, i.publish_generation, (SELECT count(pg_notify($2, '')) FROM i)
FROM p LEFT JOIN i ON true`

// PurgeSQL deletes one batch of terminal rows older than the window, with their outbox
// intents, recorded steps and history events. A row completed
// before the cutoff also started before it, which lets the started_at index find them.
// The outer conditions are checked again on the row version it deletes, so a row re-run
// meanwhile stays.
const PurgeSQL = `
WITH d AS (
	DELETE FROM processed_jobs
	WHERE idempotency_key IN (
		SELECT idempotency_key FROM processed_jobs
		WHERE started_at < now() - $1::bigint * interval '1 microsecond'
		  AND status IN ('completed', 'failed') AND completed_at < now() - $1::bigint * interval '1 microsecond'
		LIMIT $2 FOR UPDATE SKIP LOCKED)
	  AND status IN ('completed', 'failed') AND completed_at < now() - $1::bigint * interval '1 microsecond'
	RETURNING idempotency_key
), i AS (
	DELETE FROM job_intents WHERE idempotency_key IN (SELECT idempotency_key FROM d)
), s AS (
	DELETE FROM processed_job_steps WHERE idempotency_key IN (SELECT idempotency_key FROM d)
), h AS (
	DELETE FROM processed_job_events WHERE idempotency_key IN (SELECT idempotency_key FROM d)
)
SELECT count(*) FROM d`

const MarkStuckSQL = `
UPDATE processed_jobs SET status = 'needs_attention', updated_at = now()
WHERE status = 'in_progress' AND locked_until < now()
  AND started_at < now() - $1::bigint * interval '1 microsecond'`

// XactStatusSQL learns whether c's transaction committed. While the server that assigned
// the id runs, pg_xact_status answers exactly (and says "in progress" while a COMMIT is
// still under way). After a restart the id may have been handed out again (its records
// were never flushed), but no transaction from before the restart can still commit: the
// row then shows for certain whether the fenced write landed.
const XactStatusSQL = `
SELECT CASE WHEN pg_postmaster_start_time()::text = $2 THEN pg_xact_status($1::text::xid8) END,
       pg_postmaster_start_time()::text = $2,
       EXISTS (SELECT 1 FROM processed_jobs
               WHERE idempotency_key = $3 AND fence = $4 AND owner = $5 AND status <> 'in_progress')`

// PurgeDeadIntentsSQL deletes one batch of dead intents that finished longer ago than the
// window ($1, microseconds) and whose key has no ledger row (PurgeSQL deletes the others
// with their row), with the key's steps and history events. The batch is read from the
// job_intents_dead_idx index (migration 00112; without it the statement still works,
// scanning), locked (SKIP LOCKED: a concurrent purge takes others), each row's ledger key
// looked up by primary key (OFFSET 0 keeps that lookup a per-row probe, never a scan of
// processed_jobs for a hash join), then deleted by primary key, looked up again.
const PurgeDeadIntentsSQL = `
WITH d AS (
	DELETE FROM job_intents j
	USING (SELECT x.idempotency_key FROM job_intents x
	       WHERE x.state = 'dead' AND x.finished_at < now() - $1::bigint * interval '1 microsecond'
	         AND NOT EXISTS (SELECT FROM processed_jobs p WHERE p.idempotency_key = x.idempotency_key OFFSET 0)
	       LIMIT $2 FOR UPDATE SKIP LOCKED) b
	WHERE j.idempotency_key = b.idempotency_key
	  AND NOT EXISTS (SELECT FROM processed_jobs p WHERE p.idempotency_key = j.idempotency_key OFFSET 0)
	RETURNING j.idempotency_key
), s AS (
	DELETE FROM processed_job_steps WHERE idempotency_key IN (SELECT idempotency_key FROM d)
), h AS (
	DELETE FROM processed_job_events WHERE idempotency_key IN (SELECT idempotency_key FROM d)
)
SELECT count(*) FROM d`
