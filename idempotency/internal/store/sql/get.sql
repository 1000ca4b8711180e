-- GetSQL reads key $1's row as a record (record_columns.sql).
SELECT {{template "record_columns"}} FROM processed_jobs WHERE idempotency_key = $1
