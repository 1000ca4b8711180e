-- settleIntentSQL settles key $1's outbox intent for a delivery of its own task whose
-- answer came from the ledger without a finish of its own: 'done' ($4) for a cached
-- result, 'dead' with the reason $5 for a mismatch, a failed or stuck row or a payload the
-- worker refused. $2 is the task type and $3 the fingerprint of the task's type and
-- payload bytes, which for the intent's own task is the intent's (see
-- FinishParams.IntentSum).
UPDATE job_intents
SET state = $4, last_error = CASE WHEN $4 = 'dead' THEN $5 ELSE last_error END,
    finished_at = now(), updated_at = now()
WHERE idempotency_key = $1 AND task_type = $2 AND payload_sha256 = $3 AND state IN ('pending', 'published')
