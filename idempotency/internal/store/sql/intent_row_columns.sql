-- A fragment: the columns of an IntentRow, as scanIntentRow reads them, but its publish
-- time and trace parent, which take_pending.sql and stale_intents.sql add.
idempotency_key, task_type, payload, queue, max_retry, timeout_ms, retention_ms, publish_generation, created_at,
