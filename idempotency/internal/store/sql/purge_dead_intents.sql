-- PurgeDeadIntentsSQL deletes one batch of dead intents that finished longer ago than the
-- window ($1, microseconds) and whose key has no ledger row (PurgeSQL deletes the others
-- with their row), with the key's steps. The batch is read from the
-- job_intents_dead_idx index (migration 00112; without it the statement still works,
-- scanning), locked (SKIP LOCKED: a concurrent purge takes others), each row's ledger key
-- looked up by primary key (OFFSET 0 keeps that lookup a per-row probe, never a scan of
-- processed_jobs for a hash join), read once into an array (as in purge.sql, so that no
-- plan runs the batch again per row), then deleted by primary key, looked up again.
WITH d AS (
	DELETE FROM job_intents j
	WHERE j.idempotency_key = ANY (ARRAY(
		SELECT x.idempotency_key FROM job_intents x
		WHERE {{template "expired_dead_intents"}}
		LIMIT $2 FOR UPDATE SKIP LOCKED))
	  AND NOT EXISTS (SELECT FROM processed_jobs p WHERE p.idempotency_key = j.idempotency_key OFFSET 0)
	RETURNING j.idempotency_key
), s AS (
	DELETE FROM processed_job_steps WHERE idempotency_key IN (SELECT idempotency_key FROM d)
)
SELECT count(*) FROM d
