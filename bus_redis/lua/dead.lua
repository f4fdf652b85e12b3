-- dead: workers whose liveness beat (beat.lua) stopped, most recently silent first.
-- KEYS[1] P:alive  ARGV[1] dead after (ms)  ARGV[2] at most this many
-- ARGV[3] forget after (ms): older entries are removed (their leases ran out long ago)
-- Silence is measured against the freshest beat in P:alive, not the current time: after
-- Redis itself stalled (a fork, a slow disk) every beat is old, and nobody is dead.
-- returns their ids
local fresh = redis.call('ZREVRANGE', KEYS[1], 0, 0, 'WITHSCORES')
if #fresh == 0 then return {} end
local reference = tonumber(fresh[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. (reference - tonumber(ARGV[3])))
return redis.call('ZREVRANGEBYSCORE', KEYS[1], '(' .. (reference - tonumber(ARGV[1])), '-inf',
  'LIMIT', 0, tonumber(ARGV[2]))
