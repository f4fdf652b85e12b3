-- sweep: re-notify effective keys of one channel whose lease expired without a release
-- (their holder died), so another worker continues after one lease TTL.
-- KEYS[1] lease registry P:{C}:leases  KEYS[2] ready stream P:{C}:ready
-- ARGV[1] max keys  ARGV[2] ready MAXLEN
-- returns the re-notified keys, or {'!unusable', error} when the ready queue takes no
-- entry (a frontend wrote junk there: the worker re-creates it; nothing is lost here,
-- the keys stay due)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
local done = {}
for _, k in ipairs(due) do
  local r = redis.pcall('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', 'session', k, 'effective', '1')
  if type(r) == 'table' and r.err then return {'!unusable', r.err} end
  redis.call('ZREM', KEYS[1], k)
  done[#done + 1] = k
end
return done
