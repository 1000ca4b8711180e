-- HeartbeatMany extends a batch of claims' leases in one statement: $1..$4 are arrays
-- with one element per claim (key, fence, owner, lease in µs from now). Each lease is
-- extended, never shortened, only if its claim still holds the row ({{.Rows}}); every
-- row that was comes back with its ordinal. Rows are locked in the order of the arrays:
-- the caller sorts them by key.
UPDATE processed_jobs p
SET locked_until = greatest(p.locked_until, now() + r.lease * interval '1 microsecond'), updated_at = now()
FROM unnest($1::text[], $2::bigint[], $3::uuid[], $4::bigint[]) WITH ORDINALITY AS r(key, fence, owner, lease, ord)
WHERE p.idempotency_key = r.key AND {{.Rows}} AND p.status = 'in_progress'
RETURNING r.ord
