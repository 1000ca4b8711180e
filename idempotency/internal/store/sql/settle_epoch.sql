-- SettleEpoch's statement records queue $1's marker ($2) and Redis run_id ($3).
UPDATE redis_epochs SET epoch = $2, redis_run_id = $3, updated_at = now() WHERE queue = $1
