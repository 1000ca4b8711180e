-- CountSQL counts the rows with status $1 (a scan of the table: no index leads with status).
SELECT count(*) FROM processed_jobs WHERE status = $1
