-- A fragment: the select list that puts back the settings claim_settings.sql made (the
-- plans, then the lock_timeout), for ClaimMany and read_keys.sql.
set_config('enable_seqscan', split_part(current_setting('idemq.saved_plans'), ',', 1), true),
	       set_config('enable_hashjoin', split_part(current_setting('idemq.saved_plans'), ',', 2), true),
	       set_config('enable_mergejoin', split_part(current_setting('idemq.saved_plans'), ',', 3), true),
	       set_config('plan_cache_mode', split_part(current_setting('idemq.saved_plans'), ',', 4), true),
	       set_config('lock_timeout', current_setting('idemq.saved_lock_timeout'), true)
