-- purgeRequestKeysSQL deletes at most $2 rows older than $1 milliseconds.
DELETE FROM api_idempotency_keys WHERE ctid = ANY(ARRAY(
	SELECT ctid FROM api_idempotency_keys WHERE created_at < now() - $1 * interval '1 millisecond' LIMIT $2))
