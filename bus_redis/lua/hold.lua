-- hold: take the lease of K for an operation that runs no turn (an admin's delete, the
-- idle prune), and enter it in the lease registry as a turn's lease is, so that the lease
-- sweep re-notifies K if the holder dies holding it (a notification answered busy
-- meanwhile then waits one lease TTL, not a stranded-stream sweep).
-- KEYS[1] lease P:{C}:lease:K  KEYS[2] lease registry P:{C}:leases
-- ARGV[1] token  ARGV[2] lease ttl ms  ARGV[3] K
-- returns 1 held, 0 busy (the lease has another holder)
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), ARGV[3])
return 1
