-- HoldStepSQL is the fenced row lock that makes a step's transaction its claim's: only a
-- claim that still holds the key (and its generation) locks the row, and FOR SHARE
-- conflicts with the UPDATE of any claim, heartbeat or finish, so a takeover waits until
-- the transaction ends, or, having committed first, leaves a newer row version that the
-- lock re-checks under READ COMMITTED and finds no longer this claim's. Unlike an
-- UPDATE, it writes no new row version (no constraint checks, no index entries). The
-- step's commit is durable (synchronous_commit on) before it is reported.
SELECT set_config('synchronous_commit', 'on', true) FROM processed_jobs
WHERE idempotency_key = $1 AND {{.Args}} AND status = 'in_progress' AND generation = $4
FOR SHARE
