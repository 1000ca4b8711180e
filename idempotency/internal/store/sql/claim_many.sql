-- ClaimMany claims a batch of keys in one statement, for leased work: $1..$5 and $7
-- are arrays with one element per key (key, task type, owner, fingerprint or NULL, lease
-- in microseconds; trace id or NULL), $6 the maximum age. The lock_timeout is set before
-- it, by claim_settings.sql.
--
-- Every answer row starts with the key's ordinal in the arrays, then the row's columns
-- (ClaimRow). A key whose row is completed is answered by a plain read, without locking
-- the row or drawing a fence; the upsert re-checks everything on the newest row version
-- (ON CONFLICT reads past the snapshot), so when it takes nothing the caller reads again.
-- The settings are made once, before any row is locked; the upsert takes its rows in key
-- order.
WITH req AS (
	SELECT * FROM unnest($1::text[], $2::text[], $3::uuid[], $4::bytea[], $5::bigint[], $7::text[]) WITH ORDINALITY
		AS req(key, task_type, owner, fp, lease_us, trace_id, ord)
), settings AS (
	SELECT set_config('synchronous_commit', 'on', true) AS synchronous_commit
), cur AS (
	SELECT req.ord, p.status, p.fence, p.owner, p.payload_sha256, p.result, p.attempts, p.last_error,
	       p.locked_until, p.started_at, p.completed_at, p.generation
	FROM req JOIN processed_jobs p ON p.idempotency_key = req.key
), gate AS (
	SELECT req.*, NOT EXISTS (
	           SELECT 1 FROM cur
	           WHERE cur.ord = req.ord
	             AND NOT (status = 'in_progress' AND locked_until < now()
	                      AND started_at >= now() - $6::bigint * interval '1 microsecond'
	                      AND (payload_sha256 IS NULL OR req.fp IS NULL OR payload_sha256 = req.fp))
	       ) AS open
	FROM req
), up AS (
	INSERT INTO processed_jobs AS p
		(idempotency_key, task_type, status, fence, owner, payload_sha256, attempts, locked_until, completed_at, trace_id)
	SELECT gate.key, gate.task_type, 'in_progress',
	       nextval('processed_jobs_fence_seq'), gate.owner, gate.fp, 1,
	       now() + gate.lease_us * interval '1 microsecond', NULL, gate.trace_id
	FROM settings, gate WHERE gate.open
	ORDER BY gate.key
	ON CONFLICT (idempotency_key) DO UPDATE
	SET status = excluded.status, fence = excluded.fence, owner = excluded.owner, attempts = p.attempts + 1,
	    locked_until = excluded.locked_until, completed_at = excluded.completed_at, updated_at = now(),
	    trace_id = excluded.trace_id, payload_sha256 = coalesce(p.payload_sha256, excluded.payload_sha256)
	WHERE p.status = 'in_progress' AND p.locked_until < now()
	  AND p.started_at >= now() - $6::bigint * interval '1 microsecond'
	  AND (p.payload_sha256 IS NULL OR excluded.payload_sha256 IS NULL
	       OR p.payload_sha256 = excluded.payload_sha256)
	RETURNING p.idempotency_key, p.status, p.fence, p.owner, p.payload_sha256, p.result, p.attempts, p.last_error,
	          p.locked_until, p.started_at, p.completed_at, p.generation
), restored AS (
	-- The settings claimSettingsSQL made, put back once every row of up is written (the
	-- count reads them all, whatever the plan): a DoTx handler's own queries plan and
	-- wait as they would without the ledger.
	SELECT {{template "restore_settings"}} FROM (SELECT count(*) FROM up) written
)
SELECT req.ord, true, true, up.status, up.fence, up.owner, up.payload_sha256, up.result, up.attempts, up.last_error,
       up.locked_until, up.started_at, up.completed_at, up.generation, now(), NULL::text,
       pg_postmaster_start_time()::text, (SELECT cur.fence FROM cur WHERE cur.ord = req.ord)
FROM restored, up JOIN req ON req.key = up.idempotency_key
UNION ALL
SELECT gate.ord, false, gate.open, cur.status, cur.fence, cur.owner, cur.payload_sha256, cur.result, cur.attempts,
       cur.last_error, cur.locked_until, cur.started_at, cur.completed_at, cur.generation, now(), NULL, NULL, NULL
FROM restored, gate LEFT JOIN cur ON cur.ord = gate.ord
WHERE NOT EXISTS (SELECT 1 FROM up WHERE up.idempotency_key = gate.key)
