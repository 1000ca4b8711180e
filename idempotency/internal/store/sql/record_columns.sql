-- A fragment: a ledger row's columns as the operators read them (a record), the last
-- one whether its lease is live.
idempotency_key, task_type, status, fence, owner, generation, payload_sha256,
	result, attempts, last_error, locked_until, created_at, updated_at, started_at, completed_at, trace_id,
	coalesce(locked_until > now(), false)
