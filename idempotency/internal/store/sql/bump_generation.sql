-- bumpGenerationSQL records a republish under generation $3, unless another reconciler
-- did it first, and a republished event in the key's history (worker $4), within
-- MaxEventsPerGeneration of the ledger row's generation (0 while the key has no row).
WITH u AS (
	UPDATE job_intents SET publish_generation = $3, published_at = now(), updated_at = now()
	WHERE idempotency_key = $1 AND state = 'published' AND publish_generation = $2
	RETURNING idempotency_key, task_type
), g AS (
	SELECT coalesce((SELECT generation FROM processed_jobs WHERE idempotency_key = $1), 0) AS gen
), h AS (
	INSERT INTO processed_job_events (idempotency_key, generation, kind, task_type, task_id, worker, detail)
	SELECT u.idempotency_key, g.gen, 'republished', u.task_type, $1 || '#r' || $3::int, $4,
	       'its task was missing from Redis; republished'
	FROM u, g
	WHERE (SELECT count(*) FROM processed_job_events x WHERE x.idempotency_key = $1 AND x.generation = g.gen) < 50
)
SELECT count(*) FROM u
