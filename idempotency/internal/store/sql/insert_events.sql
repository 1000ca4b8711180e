-- InsertEvents records a batch of events ($1..$10, arrays with one element per event).
-- A key and generation keeps at most MaxEventsPerGeneration rows: an event is inserted
-- only while the rows already there plus those before it in the batch stay within the
-- cap (the count reads the (idempotency_key, id) index). Two processes inserting for one
-- key at the same moment may each see the other's rows missing and pass the cap by a few.
-- Rows the table's checks would refuse are left out rather than failing the round they
-- ride (the Go side cleans them first; this is the guard).
WITH e AS (
	SELECT e.*, row_number() OVER (PARTITION BY e.key, e.gen ORDER BY e.ord) AS rn
	FROM unnest($1::text[], $2::int[], $3::timestamptz[], $4::text[], $5::text[], $6::text[], $7::text[],
	            $8::bigint[], $9::bigint[], $10::text[]) WITH ORDINALITY
		AS e(key, gen, at, kind, task_type, task_id, worker, fence, old_fence, detail, ord)
	WHERE octet_length(e.key) BETWEEN 1 AND 255 AND e.kind ~ '^[a-z_]{1,32}$' AND e.gen >= 0
	  AND coalesce(octet_length(e.detail), 0) <= 1024 -- MaxEventDetail
)
INSERT INTO processed_job_events (idempotency_key, generation, at, kind, task_type, task_id, worker, fence, old_fence, detail)
SELECT e.key, e.gen, e.at, e.kind, e.task_type, e.task_id, e.worker, e.fence, e.old_fence, e.detail
FROM e
WHERE e.rn + (SELECT count(*) FROM processed_job_events x
              WHERE x.idempotency_key = e.key AND x.generation = e.gen) <= 50 -- MaxEventsPerGeneration
ORDER BY e.ord
