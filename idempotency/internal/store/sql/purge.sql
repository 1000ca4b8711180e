-- PurgeSQL deletes one batch of terminal rows older than the window, with their outbox
-- intents and recorded steps (history events go by the day: store.DropEventDay). A row
-- completed before the cutoff also started before it, which lets the started_at index
-- find them.
-- The batch is read once, into an array (an IN (subquery) may be planned as a semi join
-- that runs the subquery again for each row, LIMIT and all, and deletes far more than a
-- batch). The outer conditions are checked again on the row version it deletes, so a row
-- re-run meanwhile stays.
WITH d AS (
	DELETE FROM processed_jobs
	WHERE idempotency_key = ANY (ARRAY(
		SELECT idempotency_key FROM processed_jobs
		WHERE {{template "expired_rows"}}
		LIMIT $2 FOR UPDATE SKIP LOCKED))
	  AND status IN ('completed', 'failed') AND completed_at < now() - $1::bigint * interval '1 microsecond'
	RETURNING idempotency_key
), i AS (
	DELETE FROM job_intents WHERE idempotency_key IN (SELECT idempotency_key FROM d)
), s AS (
	DELETE FROM processed_job_steps WHERE idempotency_key IN (SELECT idempotency_key FROM d)
)
SELECT count(*) FROM d
