-- cron_add: add a schedule to a durable session, fenced by the lease its turn runs under.
-- KEYS[1] lease of the turn  KEYS[2] channel's schedule definitions  KEYS[3] channel's due
-- index  KEYS[4] the session's schedules (set of ids)
-- ARGV[1] token  ARGV[2] schedule id  ARGV[3] definition (JSON)  ARGV[4] first firing (ms)
-- KEYS[5] channel's schedule id -> scope  KEYS[6] channel's scope -> schedules it holds
-- ARGV[5] at most this many schedules per session  ARGV[6] per channel  ARGV[7] the
-- session's scope  ARGV[8] at most this many schedules per scope
-- returns 1 added, 2 added already (the same call, run again), 0 the session is full,
-- -2 the channel is, -3 the scope is, -1 lease lost
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
if redis.call('HEXISTS', KEYS[2], ARGV[2]) == 1 then return 2 end
if redis.call('SCARD', KEYS[4]) >= tonumber(ARGV[5]) then
  -- ids whose definition went (purged as unreadable: its session was not known) are
  -- dropped here (at most the session's limit of ids, all its set holds)
  for _, id in ipairs(redis.call('SMEMBERS', KEYS[4])) do
    if redis.call('HEXISTS', KEYS[2], id) == 0 then redis.call('SREM', KEYS[4], id) end
  end
  if redis.call('SCARD', KEYS[4]) >= tonumber(ARGV[5]) then return 0 end
end
if redis.call('ZCARD', KEYS[3]) >= tonumber(ARGV[6]) then return -2 end
if tonumber(redis.call('HGET', KEYS[6], ARGV[7]) or 0) >= tonumber(ARGV[8]) then return -3 end
redis.call('HSET', KEYS[5], ARGV[2], ARGV[7])
redis.call('HINCRBY', KEYS[6], ARGV[7], 1)
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
redis.call('ZADD', KEYS[3], ARGV[4], ARGV[2])
redis.call('SADD', KEYS[4], ARGV[2])
return 1
