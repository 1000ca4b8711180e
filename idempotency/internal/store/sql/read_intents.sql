-- readIntentsSQL reads the task type, fingerprint and state of the intents of the keys in
-- $1.
SELECT idempotency_key, task_type, payload_sha256, state FROM job_intents WHERE idempotency_key = ANY($1::text[])
