-- CountsSQL counts, over the window of $1 seconds, the rows started in it by status and
-- lease (live: in progress with locked_until > now()), through the started_at index, and
-- the events recorded in it by kind, through the at index. Rows: ('row', status, live, n)
-- and ('event', kind, false, n).
SELECT 'row', status, coalesce(status = 'in_progress' AND locked_until > now(), false), count(*)
FROM processed_jobs WHERE started_at >= now() - make_interval(secs => $1)
GROUP BY 2, 3
UNION ALL
SELECT 'event', kind, false, count(*)
FROM processed_job_events WHERE at >= now() - make_interval(secs => $1)
GROUP BY 2
