-- A fragment: the terminal processed_jobs rows completed before the window ($1,
-- microseconds), found from the started_at index (a row completed before the cutoff
-- also started before it). purge.sql deletes them, purge_backlog.sql counts them.
started_at < now() - $1::bigint * interval '1 microsecond'
		  AND status IN ('completed', 'failed') AND completed_at < now() - $1::bigint * interval '1 microsecond'
