-- HoldKeys (and HoldKeyWait, {{.Wait}}) begins a DoTx transaction's work with the claims'
-- settings (claim_settings.sql: the plans of the read that follows turned to the primary
-- keys, and lock waits bounded by $1, as "2000ms"): it takes each key's advisory lock ($2,
-- text[]; {{.Hold}}: a lock another transaction holds is not waited for, unless Wait,
-- when the one key waits for it up to $1 ({{.HoldWait}}) and a lock timeout refuses the
-- statement), records which it took in the transaction's idemq.held setting (a string
-- of 't' and 'f', in the keys' order), bounds how long the transaction may sit idle ($3,
-- as "30000ms"), makes its commit durable, and answers the transaction's id and the
-- server's start time, for a COMMIT whose answer is lost. Unfenced, it takes no lock and
-- records every key as held.
{{template "claim_settings"}},
	       set_config('idle_in_transaction_session_timeout', $3, true),
	       set_config('synchronous_commit', 'on', true),
	       set_config('idemq.held', (SELECT string_agg(CASE WHEN {{if .Wait}}{{.HoldWait}}{{else}}{{.Hold}}{{end}} THEN 't' ELSE 'f' END, '' ORDER BY ord)
	                                 FROM unnest($2::text[]) WITH ORDINALITY AS k(key, ord)), true),
	       pg_current_xact_id()::text, pg_postmaster_start_time()::text
