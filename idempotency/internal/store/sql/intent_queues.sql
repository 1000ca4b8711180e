-- intentQueuesSQL reads the queues the outbox recorded for keys.
SELECT idempotency_key, queue FROM job_intents WHERE idempotency_key = ANY($1)
