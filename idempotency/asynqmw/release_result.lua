-- Releases a scope's lock and writes a task's result in one call (a single Redis server:
-- on a cluster the two keys may live in different slots, and go as two calls).
-- KEYS[1]: the lock's Redis key, KEYS[2]: asynq's task hash. ARGV[1]: our lock token,
-- ARGV[2]: the result.
-- Returns {released, written}: released is 1 when the lock held our token and is deleted,
-- 0 when it was not ours (or gone); written is result_write.lua's answer.
local released = 0
if redis.call("GET", KEYS[1]) == ARGV[1] then
  released = redis.call("DEL", KEYS[1])
end
local written = -1
if redis.call("HEXISTS", KEYS[2], "msg") == 1 then
  written = redis.call("HSET", KEYS[2], "result", ARGV[2])
end
return {released, written}
