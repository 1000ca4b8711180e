-- RerunSQL reopens a terminal row (or an in-progress one whose lease has lapsed and whose
-- outbox intent is dead: its task was archived after its retries ran out, so nothing would
-- deliver it again) as a new generation whose lease has already ended, so
-- the next delivery claims it with a new fence, and, in the same statement, hands the
-- key's outbox intent (if it has one) back to the relays for a publish under the next
-- TaskID: its publish_generation goes one past the highest the relays and the reconciler
-- have used (they record every TaskID they publish under there), so the new task is
-- key#r<n> and never collides with a TaskID asynq still holds. The older generations'
-- recorded steps are deleted: the new generation runs every step again; their history is
-- kept, and a rerun event (worker $3) starts the new generation's. The relays are woken
-- (channel $2) when the statement commits. It returns the new generation and the new
-- publish generation (NULL without an intent).
WITH p AS (
	UPDATE processed_jobs
	SET status = 'in_progress', generation = generation + 1, fence = nextval('processed_jobs_fence_seq'),
	    owner = gen_random_uuid(), locked_until = now(), started_at = now(), updated_at = now(),
	    result = NULL, completed_at = NULL, trace_id = NULL
	WHERE idempotency_key = $1 AND (status IN ('completed', 'failed', 'needs_attention')
	      OR status = 'in_progress' AND locked_until < now()
	         AND EXISTS (SELECT FROM job_intents WHERE idempotency_key = $1 AND state = 'dead'))
	RETURNING generation, fence, task_type
), i AS (
	UPDATE job_intents
	SET state = 'pending', publish_generation = publish_generation + 1, relay_until = NULL,
	    last_error = NULL, finished_at = NULL, updated_at = now()
	WHERE idempotency_key = $1 AND EXISTS (SELECT FROM p)
	RETURNING publish_generation
), s AS (
	DELETE FROM processed_job_steps WHERE idempotency_key = $1 AND generation < (SELECT generation FROM p)
), h AS (
	INSERT INTO processed_job_events (idempotency_key, generation, kind, task_type, task_id, worker, fence, detail)
	SELECT $1, p.generation, 'rerun', p.task_type, CASE WHEN i.publish_generation IS NOT NULL THEN $1 || '#r' || i.publish_generation END,
	       $3, p.fence, 'reopened by an operator as generation ' || p.generation
	FROM p LEFT JOIN i ON true
)
SELECT p.generation, i.publish_generation, (SELECT count(pg_notify($2, '')) FROM i)
FROM p LEFT JOIN i ON true
