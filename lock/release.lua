-- Release the lock only while it still holds our token.
-- KEYS[1]: the lock's Redis key. ARGV[1]: our token.
-- Returns 1 when the key was ours and is now deleted, 0 when it was not ours (or gone).
if redis.call("GET", KEYS[1]) == ARGV[1] then
	return redis.call("DEL", KEYS[1])
end
return 0
