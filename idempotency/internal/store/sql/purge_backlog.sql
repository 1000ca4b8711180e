-- PurgeBacklogSQL counts what PurgeSQL and PurgeDeadIntentsSQL would still delete past
-- the window ($1, microseconds): terminal rows, read as PurgeSQL reads them (from the
-- started_at index), and dead intents without a ledger row (job_intents_dead_idx, each
-- key's row probed by primary key). Each count stops at $2 rows, so that a large backlog
-- costs no more to count than $2 index entries of each table.
SELECT (SELECT count(*) FROM (
		SELECT FROM processed_jobs
		WHERE started_at < now() - $1::bigint * interval '1 microsecond'
		  AND status IN ('completed', 'failed') AND completed_at < now() - $1::bigint * interval '1 microsecond'
		LIMIT $2) r)
     + (SELECT count(*) FROM (
		SELECT FROM job_intents x
		WHERE x.state = 'dead' AND x.finished_at < now() - $1::bigint * interval '1 microsecond'
		  AND NOT EXISTS (SELECT FROM processed_jobs p WHERE p.idempotency_key = x.idempotency_key OFFSET 0)
		LIMIT $2) d)
