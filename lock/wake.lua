-- Tell the Batchers whose callers waited for a lock that it was released.
-- No keys. ARGV[1]: the message; ARGV[2..]: their channels.
for i = 2, #ARGV do
	redis.call("PUBLISH", ARGV[i], ARGV[1])
end
return #ARGV - 1
