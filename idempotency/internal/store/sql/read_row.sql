-- ReadRow's statement reads a row for a claim that lost a race, in the shape of ClaimMany's rows.
SELECT false, false, status, fence, owner, payload_sha256, result, attempts, last_error,
       locked_until, started_at, completed_at, generation, now(), NULL::text, NULL::text, NULL::bigint
FROM processed_jobs WHERE idempotency_key = $1
