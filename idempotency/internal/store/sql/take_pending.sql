-- takePendingSQL takes up to $1 pending intents (only keys in $3 when it is not NULL) for
-- $2 ms in one short statement: SKIP LOCKED lets every replica's relay run at once.
UPDATE job_intents SET relay_until = now() + $2::bigint * interval '1 millisecond', updated_at = now()
WHERE idempotency_key IN (
	SELECT idempotency_key FROM job_intents
	WHERE state = 'pending' AND (relay_until IS NULL OR relay_until < now())
	  AND ($3::text[] IS NULL OR idempotency_key = ANY($3::text[]))
	ORDER BY created_at
	LIMIT $1
	FOR UPDATE SKIP LOCKED)
RETURNING {{template "intent_row_columns"}} coalesce(published_at, created_at),
	coalesce(trace_parent, '')
