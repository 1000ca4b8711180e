-- ReadStepsSQL reads the steps recorded for a key's generation ($1, $2).
SELECT {{template "step_columns"}} FROM processed_job_steps s
WHERE s.idempotency_key = $1 AND s.generation = $2
