-- Mark a busy lock wanted (Options.Want), unless it is marked already, and tell the
-- holder's Batcher that a caller waits for it (Batcher.Wanted), when the holder has one.
-- KEYS[1]: the lock's wanted key. ARGV[1]: how long the mark lasts, in milliseconds.
-- ARGV[2]: the holder's channel ("": none); ARGV[3]: the message for it.
-- Returns 1 when it set the mark, 0 when one was there.
if ARGV[2] ~= nil and ARGV[2] ~= "" then
	redis.call("PUBLISH", ARGV[2], ARGV[3])
end
if redis.call("SET", KEYS[1], "1", "NX", "PX", ARGV[1]) then
	return 1
end
return 0
