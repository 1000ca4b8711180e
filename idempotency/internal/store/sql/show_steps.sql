-- ShowStepsSQL reads the steps of a key's current generation (its processed_jobs row's),
-- in the order the run called them.
SELECT {{template "step_columns"}}
FROM processed_job_steps s
JOIN processed_jobs j ON j.idempotency_key = s.idempotency_key AND j.generation = s.generation
WHERE s.idempotency_key = $1
ORDER BY s.seq
