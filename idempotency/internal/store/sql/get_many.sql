-- GetManySQL reads the rows of the keys in $1 (text[]).
SELECT {{template "record_columns"}} FROM processed_jobs WHERE idempotency_key = ANY($1::text[])
