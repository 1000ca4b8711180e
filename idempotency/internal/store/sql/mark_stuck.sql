-- MarkStuckSQL turns every in-progress row whose lease expired and that started more
-- than $1 microseconds ago (the maximum age) into needs_attention.
UPDATE processed_jobs SET status = 'needs_attention', updated_at = now()
WHERE status = 'in_progress' AND locked_until < now()
  AND started_at < now() - $1::bigint * interval '1 microsecond'
