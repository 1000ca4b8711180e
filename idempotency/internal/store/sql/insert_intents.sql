-- insertIntentsSQL records many intents in one statement, in the order given (key order,
-- so that concurrent batches lock their rows in one order), held from the relays for $10
-- ms when $10 > 0.
INSERT INTO job_intents (idempotency_key, task_type, payload, payload_sha256, queue, max_retry, timeout_ms, retention_ms, trace_parent, relay_until)
SELECT u.k, u.t, u.p, u.f, u.q, u.m, u.o, u.r, nullif(u.tp, ''), CASE WHEN $10::bigint > 0 THEN now() + $10::bigint * interval '1 millisecond' END
FROM unnest($1::text[], $2::text[], $3::bytea[], $4::bytea[], $5::text[], $6::int[], $7::bigint[], $8::bigint[], $9::text[]) AS u(k, t, p, f, q, m, o, r, tp)
ON CONFLICT (idempotency_key) DO NOTHING
RETURNING idempotency_key, state
