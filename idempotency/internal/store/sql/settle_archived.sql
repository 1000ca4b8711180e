-- settleArchivedSQL settles dead, with the reason $3, a published intent whose own task
-- asynq archived (its retries ran out, or the worker refused it without settling the
-- intent itself), unless another reconciler or a delivery settled or republished it first.
UPDATE job_intents SET state = 'dead', last_error = $3, finished_at = now(), updated_at = now()
WHERE idempotency_key = $1 AND state = 'published' AND publish_generation = $2
