-- delete: remove a durable session under its lease (so no running turn re-creates it),
-- with its schedules, its tool journal and its subagents' registrations.
-- KEYS[1] lease of the holder  KEYS[2] session hash  KEYS[3] channel's sessions index
-- KEYS[4] scope index of the session ('' scope: KEYS[3] again)  KEYS[5] the session's events
-- KEYS[6] its tool journal  KEYS[7] its schedules (set of ids)  KEYS[8] the channel's
-- schedule definitions  KEYS[9] the channel's due index  KEYS[10] its running subagents
-- KEYS[11] the channel's index of sessions with subagents  KEYS[12] their scopes
-- KEYS[13] channel's schedule id -> scope  KEYS[14] channel's scope -> schedules it holds
-- ARGV[1] token  ARGV[2] the session key  ARGV[3] the delete marker's id: of the events,
-- only the error answers written from its millisecond on stay (the cancelled answers of
-- the messages it covers; no text of the conversation, not even an answer that ended
-- after the marker); '' (an operator): all of them go. (Only the millisecond compares:
-- the marker's id is of the inbound stream, the events' of the out stream, each with its
-- own sequence numbers.)
-- returns 1 deleted, 0 nothing stored, -1 lease lost
-- Work is bounded: a session has at most AGENT_CRON_MAX_PER_SESSION schedules.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
redis.call('ZREM', KEYS[3], ARGV[2])
redis.call('ZREM', KEYS[4], ARGV[2])
for _, id in ipairs(redis.call('SMEMBERS', KEYS[7])) do
  redis.call('HDEL', KEYS[8], id)
  redis.call('ZREM', KEYS[9], id)
  forget_cron_scope(KEYS[13], KEYS[14], id)
end
local since = ARGV[3] and string.match(ARGV[3], '^(%d+)')
if since and keep_error_events(KEYS[5], since .. '-0') then
  if redis.call('XLEN', KEYS[5]) == 0 then redis.call('DEL', KEYS[5]) end  -- none: no stream
else
  redis.call('DEL', KEYS[5])
end
redis.call('DEL', KEYS[6], KEYS[7], KEYS[10])
redis.call('ZREM', KEYS[11], ARGV[2])
redis.call('HDEL', KEYS[12], ARGV[2])
return redis.call('DEL', KEYS[2])
