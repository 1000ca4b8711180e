-- KeyEvents' statement reads key $1's newest $2 events (by id: the order they were written),
-- in the order they happened: a delivery's event waits in its process's buffer for up to
-- a second while an operator's rerun is written at once, so at orders them (then id).
SELECT id, generation, at, kind, coalesce(task_type, ''), coalesce(task_id, ''), coalesce(worker, ''),
       coalesce(fence, 0), coalesce(old_fence, 0), coalesce(detail, '')
FROM (SELECT * FROM processed_job_events WHERE idempotency_key = $1 ORDER BY id DESC LIMIT $2) e
ORDER BY at, id
