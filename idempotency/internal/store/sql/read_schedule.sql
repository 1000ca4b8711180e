-- ReadScheduleSQL reads every entry with the outbox state of its last tick's job.
SELECT s.name, s.revision, s.spec::text, s.spec_sha256, s.paused, s.revised_at, s.paused_at, s.resumed_at, s.last_tick, s.last_key, i.state
FROM schedule_entries s LEFT JOIN job_intents i ON i.idempotency_key = s.last_key
ORDER BY s.name
