-- Starts the events' own transaction (the one after a DoTx finish's COMMIT, or the
-- background write's): it commits asynchronously (a crash of Postgres may lose what it
-- wrote in the last moments, at most three times wal_writer_delay, never anything another
-- transaction depends on) and waits at most EventsLockTimeout for a lock.
SELECT set_config('synchronous_commit', 'off', true), set_config('lock_timeout', '{{.EventsLockTimeout}}', true)
