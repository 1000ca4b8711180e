-- Heartbeat extends a claim's lease ($4 µs from now, never shortening it), fenced.
UPDATE processed_jobs
SET locked_until = greatest(locked_until, now() + $4::bigint * interval '1 microsecond'), updated_at = now()
WHERE idempotency_key = $1 AND {{.Args}} AND status = 'in_progress'
RETURNING locked_until
