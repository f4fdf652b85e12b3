-- take (the baseline loop of bench/baseline.py, not the product): lease a session, read its
-- first queued entry and the last 40 rows of its history.
-- KEYS[1] lease  KEYS[2] inbound stream  KEYS[3] history (list)
-- ARGV[1] token  ARGV[2] lease TTL (ms)
-- returns {} (busy or nothing queued) or {entry id, payload, row, row, ...}
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return {} end
local first = redis.call('XRANGE', KEYS[2], '-', '+', 'COUNT', 1)
if #first == 0 then
  redis.call('DEL', KEYS[1])
  return {}
end
local reply = {first[1][1], first[1][2][2]}
for _, row in ipairs(redis.call('LRANGE', KEYS[3], -40, -1)) do reply[#reply + 1] = row end
return reply
