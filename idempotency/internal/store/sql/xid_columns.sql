-- A fragment: the columns that end every finish's answer rows: the transaction id, read
-- before the commit is asked for (see Round), and the server's start time; and they turn
-- synchronous_commit on for the commit that follows.
pg_current_xact_id()::text, pg_postmaster_start_time()::text, set_config('synchronous_commit', 'on', true)
