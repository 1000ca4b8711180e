-- readRequestKeysSQL reads the rows of the request keys ($1 routes, $2 header keys) that
-- are there.
SELECT k.route, k.header_key, k.fingerprint, k.job_key, k.task_type, k.status_code, k.response
FROM api_idempotency_keys k JOIN unnest($1::text[], $2::text[]) AS r(route, header_key) USING (route, header_key)
