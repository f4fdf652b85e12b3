-- sweep: re-notify effective keys of one channel whose lease expired without a release
-- (their holder died), so another worker continues after one lease TTL. The notification
-- is marked effective only in the unified channel (its key drains a pending set); any
-- other key is its own stream, re-notified as a plain notification that a worker of any
-- version serves by reading that stream.
-- KEYS[1] lease registry P:{C}:leases  KEYS[2] ready stream P:{C}:ready
-- ARGV[1] max keys  ARGV[2] ready MAXLEN  ARGV[3] '1' in the unified channel
-- returns the re-notified keys, or {'!unusable', error} when the ready queue takes no
-- entry (a frontend wrote junk there: the worker re-creates it; nothing is lost here,
-- the keys stay due)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
local done = {}
for _, k in ipairs(due) do
  local r
  if ARGV[3] == '1' then
    r = redis.pcall('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', 'session', k, 'effective', '1')
  else
    r = redis.pcall('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', 'session', k)
  end
  if type(r) == 'table' and r.err then return {'!unusable', r.err} end
  redis.call('ZREM', KEYS[1], k)
  done[#done + 1] = k
end
return done
