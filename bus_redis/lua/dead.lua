-- dead: workers whose liveness beat (beat.lua) stopped, by Redis' clock.
-- KEYS[1] P:alive  ARGV[1] dead after (ms)  ARGV[2] at most this many
-- returns their ids, oldest beat first
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[1]),
  'LIMIT', 0, tonumber(ARGV[2]))
