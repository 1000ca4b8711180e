-- IntentTasks' statement reads the queue and publish generation of the intents of the
-- keys in $1.
SELECT idempotency_key, queue, publish_generation FROM job_intents WHERE idempotency_key = ANY($1)
