-- A fragment: the dead intents x that finished before the window ($1, microseconds) and
-- whose key has no ledger row (OFFSET 0 keeps that lookup a per-row probe by primary
-- key). purge_dead_intents.sql deletes them, purge_backlog.sql counts them.
x.state = 'dead' AND x.finished_at < now() - $1::bigint * interval '1 microsecond'
		  AND NOT EXISTS (SELECT FROM processed_jobs p WHERE p.idempotency_key = x.idempotency_key OFFSET 0)
