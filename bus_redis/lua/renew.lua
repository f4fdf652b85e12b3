-- renew: extend a lease we still hold (and the pending set that goes with it).
-- KEYS[1] lease  KEYS[2] pending  KEYS[3] lease registry of K's channel
-- ARGV[1] token  ARGV[2] ttl ms  ARGV[3] K
-- returns 1 renewed, 0 lost
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('PEXPIRE', KEYS[2], 2 * tonumber(ARGV[2]))
redis.call('ZADD', KEYS[3], now + tonumber(ARGV[2]), ARGV[3])
return 1
