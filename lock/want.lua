-- Mark a busy lock wanted (Options.Want), unless it is marked already.
-- KEYS[1]: the lock's wanted key. ARGV[1]: how long the mark lasts, in milliseconds.
-- Returns 1 when it set the mark, 0 when one was there.
if redis.call("SET", KEYS[1], "1", "NX", "PX", ARGV[1]) then
	return 1
end
return 0
