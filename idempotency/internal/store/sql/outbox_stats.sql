-- outboxStatsSQL reads the outbox's backlog: the pending and published intents, the
-- age of the oldest of each, and how many were published more than $1 ms ago.
SELECT count(*) FILTER (WHERE state = 'pending'),
       coalesce(extract(epoch FROM now() - min(created_at) FILTER (WHERE state = 'pending')), 0)::float8,
       count(*) FILTER (WHERE state = 'published'),
       coalesce(extract(epoch FROM now() - min(published_at) FILTER (WHERE state = 'published')), 0)::float8,
       count(*) FILTER (WHERE state = 'published' AND published_at < now() - $1::bigint * interval '1 millisecond')
FROM job_intents WHERE state IN ('pending', 'published')
