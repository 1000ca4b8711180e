-- forgetRequestKeysSQL deletes the rows of the request keys ($1 routes, $2 header keys).
DELETE FROM api_idempotency_keys k
USING unnest($1::text[], $2::text[]) AS r(route, header_key)
WHERE k.route = r.route AND k.header_key = r.header_key
