-- intentInfoSQL reads key $1's intent (intent_info_columns.sql and its trace parent).
SELECT {{template "intent_info_columns"}}, coalesce(trace_parent, '')
	FROM job_intents WHERE idempotency_key = $1
