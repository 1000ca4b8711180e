-- PurgeBacklogSQL counts what PurgeSQL and PurgeDeadIntentsSQL would still delete past
-- the window ($1, microseconds): terminal rows, read as PurgeSQL reads them (from the
-- started_at index), and dead intents without a ledger row (job_intents_dead_idx, each
-- key's row probed by primary key). Each count stops at $2 rows, so that a large backlog
-- costs no more to count than $2 index entries of each table.
SELECT (SELECT count(*) FROM (
		SELECT FROM processed_jobs
		WHERE {{template "expired_rows"}}
		LIMIT $2) r)
     + (SELECT count(*) FROM (
		SELECT FROM job_intents x
		WHERE {{template "expired_dead_intents"}}
		LIMIT $2) d)
