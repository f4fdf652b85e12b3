-- owner: renew or drop the owner record of a transient session.
-- KEYS[1] owner  KEYS[2] owners registry
-- ARGV[1] op ('renew' | 'drop' | 'abandon': delete the record, keep the registry entry)  ARGV[2] worker id  ARGV[3] registry member  ARGV[4] ttl ms
-- returns 1 done, 0 the record is not ours (renew: it expired or moved)
local cur = redis.call('HGET', KEYS[1], 'worker')
if ARGV[1] == 'abandon' then
  if cur == ARGV[2] then redis.call('DEL', KEYS[1]) end
  return 1
end
if ARGV[1] == 'drop' then
  if cur == ARGV[2] then redis.call('DEL', KEYS[1]) end
  redis.call('ZREM', KEYS[2], ARGV[3])
  return 1
end
if cur ~= ARGV[2] then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('PEXPIRE', KEYS[1], ARGV[4])
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[4]), ARGV[3])
return 1
