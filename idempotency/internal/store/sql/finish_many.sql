-- FinishMany ends a batch of claims in one statement: $1..$7 are arrays with one
-- element per claim (key, fence, owner, action, result, error, intent sum), where action is
-- 'complete' (the row completed with its result), 'retry' (the lease ends at once, the
-- row stays in progress) or 'fail' (failed for good). Each row is updated only if its
-- claim still holds it; every row that was comes back with its ordinal and the
-- transaction id (see Round). Completions and permanent failures settle their outbox
-- intents in the same statement, when the delivery was of the intent's own task
-- (intent_own.sql).
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
	WHERE p.idempotency_key = r.key AND {{.Rows}} AND p.status = 'in_progress'
	RETURNING r.ord, p.idempotency_key, p.status, p.last_error
), i AS (
	UPDATE job_intents j SET finished_at = now(), updated_at = now(),
	       state = CASE WHEN c.status = 'completed' THEN 'done' ELSE 'dead' END,
	       last_error = CASE WHEN c.status = 'completed' THEN j.last_error ELSE c.last_error END
	FROM c JOIN r ON r.ord = c.ord
	WHERE j.idempotency_key = c.idempotency_key AND c.status IN ('completed', 'failed')
	  AND j.state IN ('pending', 'published') AND {{template "intent_own"}}
)
SELECT c.ord, {{template "xid_columns"}} FROM c
