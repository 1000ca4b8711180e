-- markPublishFailedSQL records $3 as the last error of the intents of keys $1 still
-- pending, and holds them from the relays for $2 ms.
UPDATE job_intents SET relay_until = now() + $2::bigint * interval '1 millisecond', last_error = $3, updated_at = now()
WHERE idempotency_key = ANY($1::text[]) AND state IS NOT DISTINCT FROM 'pending'
