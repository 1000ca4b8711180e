-- Extend the lock only while it still holds our token.
-- KEYS[1]: the lock's Redis key. ARGV[1]: our token. ARGV[2]: the new TTL in milliseconds.
-- Returns 1 when the key was ours and its TTL is reset, 0 when it was not ours (or gone).
if redis.call("GET", KEYS[1]) == ARGV[1] then
	return redis.call("PEXPIRE", KEYS[1], ARGV[2])
end
return 0
