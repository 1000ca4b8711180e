-- ListSQL lists the newest $2 rows by updated_at, of status $1 ('' for any).
SELECT {{template "record_columns"}} FROM processed_jobs
WHERE $1 = '' OR status = $1 ORDER BY updated_at DESC, idempotency_key LIMIT $2
