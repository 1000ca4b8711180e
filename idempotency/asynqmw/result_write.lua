-- Writes a task's result only while asynq still has the task: KEYS[1] is asynq's task hash,
-- ARGV[1] the result. A hash without its message means Redis lost the task (a restart
-- without persistence); writing then would leave a hash asynq can never run or expire.
if redis.call("HEXISTS", KEYS[1], "msg") == 1 then
  return redis.call("HSET", KEYS[1], "result", ARGV[1])
end
return -1
