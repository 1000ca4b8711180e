-- answerRequestKeysSQL sets the answer ($3 status codes, $4 bodies) of the request keys
-- ($1 routes, $2 header keys).
UPDATE api_idempotency_keys k SET status_code = a.code, response = a.body
FROM unnest($1::text[], $2::text[], $3::int[], $4::bytea[]) AS a(route, header_key, code, body)
WHERE k.route = a.route AND k.header_key = a.header_key
