-- cron_remove: remove one schedule of a session (its own turn or an operator).
-- KEYS[1] channel's schedule definitions  KEYS[2] channel's due index  KEYS[3] the
-- session's schedules
-- ARGV[1] schedule id
-- returns 1 removed, 0 the session has no such schedule
if redis.call('SREM', KEYS[3], ARGV[1]) == 0 then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
