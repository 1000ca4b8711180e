-- A fragment: an IntentInfo's columns but the trace parent.
idempotency_key, task_type, state, publish_generation, coalesce(last_error, ''),
	created_at, coalesce(published_at, 'epoch'), coalesce(finished_at, 'epoch')
