-- Report the lock's remaining TTL only while it still holds our token.
-- KEYS[1]: the lock's Redis key. ARGV[1]: our token.
-- Returns the PTTL in milliseconds (-1: no expiry), or -3 when the key is not ours (or gone).
if redis.call("GET", KEYS[1]) == ARGV[1] then
	return redis.call("PTTL", KEYS[1])
end
return -3
