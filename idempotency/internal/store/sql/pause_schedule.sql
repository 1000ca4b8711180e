-- PauseScheduleSQL pauses ($2 true) or resumes entry $1, recording when an active entry
-- was paused and when a paused one was resumed; it reports whether it exists.
UPDATE schedule_entries SET paused = $2, updated_at = now(),
    paused_at = CASE WHEN $2 AND NOT paused THEN now() ELSE paused_at END,
    resumed_at = CASE WHEN NOT $2 AND paused THEN now() ELSE resumed_at END
WHERE name = $1
