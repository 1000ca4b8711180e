-- RecordStepSQL records a step in one statement (its own transaction): the fenced row
-- lock of hold_step.sql and, only if it matched, the step's row. It writes one row or none.
WITH u AS (
	SELECT idempotency_key, generation, fence FROM processed_jobs
	WHERE idempotency_key = $1 AND {{.Args}} AND status = 'in_progress' AND generation = $4
	FOR SHARE
)
INSERT INTO processed_job_steps (idempotency_key, generation, step, seq, fence, input_fingerprint, result)
SELECT u.idempotency_key, u.generation, $5, $6, u.fence, $7, $8::text::jsonb
FROM u WHERE set_config('synchronous_commit', 'on', true) IS NOT NULL {{.StepConflict}}
