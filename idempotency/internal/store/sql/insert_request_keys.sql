-- insertRequestKeysSQL records many request keys in one statement, each with its answer,
-- and returns those it recorded.
INSERT INTO api_idempotency_keys (route, header_key, fingerprint, job_key, task_type, status_code, response)
SELECT * FROM unnest($1::text[], $2::text[], $3::bytea[], $4::text[], $5::text[], $6::int[], $7::bytea[])
ON CONFLICT DO NOTHING RETURNING route, header_key
