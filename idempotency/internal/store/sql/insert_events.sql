-- InsertEvents records a batch of events ($1..$10, arrays with one element per event).
-- A key and generation keeps at most MaxEventsPerGeneration rows a day: an event is
-- inserted only while the rows already there in the days of the batch ([$11, $12), the
-- UTC days its events fall in) plus those before it in the batch stay within the cap.
-- The count reads the (idempotency_key, id) index of those days' partitions only: the
-- table is partitioned by day (00114), and $11 and $12, known when the statement is
-- planned, leave the other days out of the plan. Two processes inserting for one
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
              WHERE x.idempotency_key = e.key AND x.generation = e.gen
                AND x.at >= $11::timestamptz AND x.at < $12::timestamptz) <= 50 -- MaxEventsPerGeneration
ORDER BY e.ord
