-- unfinishedIntentsSQL reads up to $1 intents still pending or published, oldest first,
-- without their trace parents.
SELECT {{template "intent_info_columns"}}
	FROM job_intents WHERE state IN ('pending', 'published') ORDER BY created_at LIMIT $1
