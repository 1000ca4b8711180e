-- markPublishedSQL records the publishes of keys $1, each under the generation at the same
-- index of $2, of intents still pending under the generation they were taken under ($3):
-- an intent an operator re-ran meanwhile (a new publish generation) waits for a publish
-- of its own.
--
-- It and markPublishFailedSQL find their rows by key only: "state IS NOT DISTINCT FROM
-- 'pending'" keeps the planner off job_intents_pending_idx, which statistics make look
-- small while, under load, it holds the entries of every intent published since the last
-- vacuum, and which it would otherwise scan whole on every call.
UPDATE job_intents i
SET state = 'published', published_at = now(), publish_generation = p.gen, relay_until = NULL, last_error = NULL, updated_at = now()
FROM unnest($1::text[], $2::int[], $3::int[]) AS p(key, gen, taken)
WHERE i.idempotency_key = p.key AND i.state IS NOT DISTINCT FROM 'pending' AND i.publish_generation = p.taken
