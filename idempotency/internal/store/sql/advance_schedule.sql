-- AdvanceScheduleSQL records tick $2 of entry $1, whose job is $3, as its last when it is
-- newer than the one recorded.
UPDATE schedule_entries SET last_tick = $2, last_key = $3, updated_at = now()
WHERE name = $1 AND (last_tick IS NULL OR last_tick < $2)
