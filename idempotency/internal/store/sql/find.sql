-- FindSQL is the console's list: the newest rows by started_at (its index serves the
-- order and the age filters, so LIMIT ends the scan early), under the filters of
-- FindParams. Only the filters that are set are in the statement, so each combination is
-- planned for what it asks: each is "WHERE" the first time, then "AND" ($and), and each
-- value takes the next parameter (.Arg: $1, $2, ...).
SELECT {{template "record_columns"}} FROM processed_jobs
{{- $and := "\nWHERE "}}
{{- if .Status}}{{$and}}status = {{.Arg .Status}}{{$and = "\n  AND "}}{{end}}
{{- if .TaskType}}{{$and}}task_type = {{.Arg .TaskType}}{{$and = "\n  AND "}}{{end}}
{{- if gt .StartedWithin 0}}{{$and}}started_at >= now() - make_interval(secs => {{.Arg .StartedWithin.Seconds}}){{$and = "\n  AND "}}{{end}}
{{- if gt .StartedBefore 0}}{{$and}}started_at < now() - make_interval(secs => {{.Arg .StartedBefore.Seconds}}){{$and = "\n  AND "}}{{end}}
{{- if .Live}}{{$and}}status = 'in_progress' AND locked_until > now(){{$and = "\n  AND "}}{{end}}
{{- if .Lapsed}}{{$and}}status = 'in_progress' AND (locked_until IS NULL OR locked_until <= now()){{$and = "\n  AND "}}{{end}}
{{- if .HasDuplicates}}{{$and}}EXISTS (SELECT FROM processed_job_events e
	WHERE e.idempotency_key = processed_jobs.idempotency_key AND e.kind = 'duplicate'){{end}}
ORDER BY started_at DESC, idempotency_key LIMIT {{.Arg .Limit}}
