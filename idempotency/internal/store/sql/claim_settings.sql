-- The claims' settings, sent before the leased statements of a round (Round) and at the
-- start of a DoTx transaction's statements (hold_keys.sql, finish_tx.sql), for the rest
-- of the transaction.
--
-- The multi-row statements join arrays of keys to processed_jobs and job_intents. A plan
-- made while a table was small (after a deploy, a purge or a TRUNCATE) may join by
-- scanning the whole table, and a connection keeps a prepared statement's plan as the
-- table grows: at 50,000 rows the leased stack fell to a fifth of its speed. So these
-- statements are planned with sequential scans, hash and merge joins off (the first
-- settings here; ClaimMany puts the settings back): the joins then take the primary keys
-- whatever the tables' sizes, and the plan is made once per connection, not once per
-- batch.
--
-- After them, the bound on the claims' waits for another session's row ($1, as
-- "2000ms"); ClaimMany puts both back when its rows are written (restore_settings.sql).
SELECT set_config('idemq.saved_plans', concat_ws(',', current_setting('enable_seqscan'),
	       current_setting('enable_hashjoin'), current_setting('enable_mergejoin'), current_setting('plan_cache_mode')), true),
	       set_config('enable_seqscan', 'off', true), set_config('enable_hashjoin', 'off', true),
	       set_config('enable_mergejoin', 'off', true), set_config('plan_cache_mode', 'force_generic_plan', true),
	       set_config('idemq.saved_lock_timeout', current_setting('lock_timeout'), true), set_config('lock_timeout', $1, true)
