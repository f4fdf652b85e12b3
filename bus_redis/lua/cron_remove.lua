-- cron_remove: remove one schedule of a session (its own turn or an operator).
-- KEYS[1] channel's schedule definitions  KEYS[2] channel's due index  KEYS[3] the
-- session's schedules  KEYS[4] the lease of the turn removing it (an operator: KEYS[3])
-- KEYS[5] channel's schedule id -> scope  KEYS[6] channel's scope -> schedules it holds
-- ARGV[1] schedule id  ARGV[2] that turn's lease token ('': an operator, not fenced)
-- ARGV[3] '1': an unreadable definition, its session not known (KEYS[3] is not read)
-- returns 1 removed, 0 the session has no such schedule, -1 the turn's lease is lost (a
-- stalled worker's cut turn must not undo what the holder after it committed); with
-- ARGV[4] '1', 1 comes as {1, definition, next firing ms or ''}: what was removed, read
-- in the same step (a firing between a read and the removal would be restored stale)
if ARGV[2] ~= '' and redis.call('GET', KEYS[4]) ~= ARGV[2] then return -1 end
if ARGV[3] ~= '1' and redis.call('SREM', KEYS[3], ARGV[1]) == 0 then return 0 end
local doc, due = '', ''
if ARGV[4] == '1' then
  doc = redis.call('HGET', KEYS[1], ARGV[1]) or ''
  due = redis.call('ZSCORE', KEYS[2], ARGV[1]) or ''
end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
forget_cron_scope(KEYS[5], KEYS[6], ARGV[1])
if ARGV[4] == '1' then return {1, doc, due} end
return 1
