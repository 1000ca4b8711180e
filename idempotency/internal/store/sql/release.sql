-- ReleaseSQL ends a lease and fences its holder out: a new fence and an owner nobody
-- holds, so the holder's heartbeat and completion fail with ErrLeaseLost.
UPDATE processed_jobs
SET fence = nextval('processed_jobs_fence_seq'), owner = gen_random_uuid(), locked_until = now(), updated_at = now()
WHERE idempotency_key = $1 AND status = 'in_progress'
