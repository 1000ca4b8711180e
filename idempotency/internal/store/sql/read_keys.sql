-- readKeysSQL reads the row of each key of a DoTx transaction ($1, text[]), in the shape
-- of ClaimRow, after hold_keys.sql: claimed when this transaction holds the key's advisory
-- lock and the key may be taken (no row, or one in progress whose lease ended, younger
-- than the maximum age $2 in microseconds, with the same fingerprint, $3) — then the
-- fence is a new one and the attempt the row's next; busy when the key may be taken but
-- another transaction holds its lock. It puts back the settings hold_keys.sql made
-- (restore_settings.sql), so that the handlers' own queries plan and wait as they would
-- without the ledger.
WITH k AS (
	SELECT k.ord, k.key, k.fp, substr(current_setting('idemq.held'), k.ord::int, 1) = 't' AS held,
	       p.status, p.fence, p.owner, p.payload_sha256, p.result, p.attempts, p.last_error,
	       p.locked_until, p.started_at, p.completed_at, p.generation,
	       p.status IS NULL OR p.status = 'in_progress' AND p.locked_until < now()
	         AND p.started_at >= now() - $2::bigint * interval '1 microsecond'
	         AND (p.payload_sha256 IS NULL OR k.fp IS NULL OR p.payload_sha256 = k.fp) AS open
	FROM unnest($1::text[], $3::bytea[]) WITH ORDINALITY AS k(key, fp, ord)
	LEFT JOIN processed_jobs p ON p.idempotency_key = k.key
), restored AS (
	SELECT {{template "restore_settings"}}
)
SELECT ord, held AND open, open AND NOT held, status,
       CASE WHEN held AND open THEN nextval('processed_jobs_fence_seq') ELSE fence END,
       owner, payload_sha256, result,
       CASE WHEN held AND open THEN coalesce(attempts, 0) + 1 ELSE attempts END,
       last_error, locked_until, started_at, completed_at, coalesce(generation, 0), now(), NULL::text, NULL::text,
       CASE WHEN held AND open THEN fence END
FROM restored, k ORDER BY ord
