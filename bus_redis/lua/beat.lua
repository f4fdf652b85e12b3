-- beat: a worker is alive. Its liveness beat (a thread of its own, so a busy event loop
-- does not stop it) calls this every AGENT_LIVENESS_MS / 8; survivors take over the leases
-- of a worker whose beat is older than AGENT_LIVENESS_MS (dead.lua, takeover.lua).
-- KEYS[1] P:alive (sorted set: worker id -> Redis time of its last beat, ms)
-- ARGV[1] worker id
-- returns the Redis time (ms); Redis' clock only, so clocks of workers' hosts never matter
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now, ARGV[1])
return now
