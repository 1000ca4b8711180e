-- staleIntentsSQL lists up to $4 intents published before $1, after the cursor
-- (published_at, key) = ($2, $3), in that order; only in the queues $5 unless it is NULL.
SELECT {{template "intent_row_columns"}} published_at,
       coalesce(trace_parent, '')
FROM job_intents
WHERE state = 'published' AND published_at < $1 AND (published_at, idempotency_key) > ($2, $3)
  AND ($5::text[] IS NULL OR queue = ANY($5::text[]))
ORDER BY published_at, idempotency_key
LIMIT $4
