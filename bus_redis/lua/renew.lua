-- renew: extend a lease we still hold (and the pending set that goes with it).
-- KEYS[1] lease  KEYS[2] pending
-- ARGV[1] token  ARGV[2] ttl ms
-- returns 1 renewed, 0 lost
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('PEXPIRE', KEYS[2], 2 * tonumber(ARGV[2]))
return 1
