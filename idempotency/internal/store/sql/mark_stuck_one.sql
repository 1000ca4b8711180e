-- MarkStuckOne's statement turns one expired, too old in-progress claim into needs_attention.
UPDATE processed_jobs SET status = 'needs_attention', updated_at = now()
WHERE idempotency_key = $1 AND fence = $2 AND status = 'in_progress' AND locked_until < now()
