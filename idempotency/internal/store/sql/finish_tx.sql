-- FinishTx writes the rows of a DoTx transaction's members ($1..$11, one element per
-- member: key, task type, fence, owner, fingerprint, status ('completed' or 'failed'),
-- result (jsonb text), last_error, the attempt, the generation the read found (0 for
-- none), trace id; $12 the intent sums, see FinishParams.IntentSum; $13 whether the read
-- found a row). A key the read found without a row is inserted with a plain INSERT
-- ({{.Conflict}}: a row there by now aborts the statement, a unique violation); a row the
-- read found is taken over only if it is still what the read found: in progress, its
-- lease ended, at the attempt before this one and in the same generation, with the same
-- fingerprint ({{.Takeover}}). Completions and failures settle the outbox intents of their
-- own tasks (intent_own.sql). Unless every member's row was written ({{.Guard}}), the statement fails
-- (division by zero), so that the COMMIT sent after it cannot commit: then the
-- transaction's members run again.
WITH r AS (
	SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[], $4::uuid[], $5::bytea[], $6::text[], $7::text[],
	                     $8::text[], $9::int[], $10::int[], $11::text[], $12::bytea[], $13::bool[])
		AS r(key, task_type, fence, owner, fp, status, result, error, attempt, generation, trace_id, intent_sum, found)
), ins AS (
	INSERT INTO processed_jobs AS p (idempotency_key, task_type, status, fence, owner, payload_sha256, result,
	                                 attempts, generation, last_error, locked_until, completed_at, trace_id)
	SELECT key, task_type, status, fence, owner, fp, result::jsonb, attempt, generation, error, now(), now(), trace_id
	FROM r WHERE NOT r.found ORDER BY key
	{{.Conflict}}
	RETURNING p.idempotency_key, p.status, p.last_error
), upd AS (
	UPDATE processed_jobs p
	SET status = r.status, fence = r.fence, owner = r.owner, result = r.result::jsonb, attempts = r.attempt,
	    last_error = coalesce(r.error, p.last_error), locked_until = now(), completed_at = now(), updated_at = now(),
	    trace_id = r.trace_id, payload_sha256 = coalesce(p.payload_sha256, r.fp)
	FROM r
	WHERE r.found AND p.idempotency_key = r.key AND {{.Takeover}}
	RETURNING p.idempotency_key, p.status, p.last_error
), w AS (
	SELECT * FROM ins UNION ALL SELECT * FROM upd
), i AS (
	UPDATE job_intents j SET finished_at = now(), updated_at = now(),
	       state = CASE WHEN w.status = 'completed' THEN 'done' ELSE 'dead' END,
	       last_error = CASE WHEN w.status = 'completed' THEN j.last_error ELSE w.last_error END
	FROM w JOIN r ON r.key = w.idempotency_key
	WHERE j.idempotency_key = w.idempotency_key AND j.state IN ('pending', 'published') AND {{template "intent_own"}}
)
SELECT {{.Guard}} FROM (SELECT count(*) AS n FROM w) w
