-- requestKeyJobSQL reads the task type an answered row names for job $1, if one does.
SELECT task_type FROM api_idempotency_keys WHERE job_key = $1 AND status_code IS NOT NULL LIMIT 1
