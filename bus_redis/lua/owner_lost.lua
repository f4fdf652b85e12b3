-- owner_lost: a transient session's owner stopped renewing: tell the frontend once and
-- re-notify the session so that queued messages are answered session_not_active.
-- Its earlier events are deleted (its error answers excepted): none of a private
-- session's text outlives it.
-- KEYS[1] owner  KEYS[2] owners registry  KEYS[3] out stream of S  KEYS[4] ready stream of S's channel
-- KEYS[5] the pulse of S's channel  KEYS[6] S's end (per-session mode, _events.lua)
-- KEYS[7] S's inbound stream
-- ARGV[1] registry member  ARGV[2] session_lost event JSON  ARGV[3] S  ARGV[4] MAXLEN
-- ARGV[5] out stream ttl ms  ARGV[6] how long S's end is kept, ms (0: not kept)
-- returns 1 when this call reported the loss, 0 otherwise
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
if redis.call('ZREM', KEYS[2], ARGV[1]) == 0 then return 0 end
-- the session ended: its events go with it but for its error answers (_events.lua):
-- another worker may have answered a message of it before this notice
keep_error_events(KEYS[3], '-')
-- a `new` published before now was the private session's (its frontend was not told)
write_private_end(KEYS[6], KEYS[7], ARGV[6], true)
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[4], '*', 'payload', ARGV[2])
redis.call('PEXPIRE', KEYS[3], ARGV[5])
local pulsed = redis.pcall('XADD', KEYS[5], 'MAXLEN', '~', 10000, '*', 'o', KEYS[3])  -- PULSE_MAXLEN
if type(pulsed) == 'table' and pulsed.err and string.find(tostring(pulsed.err), 'WRONGTYPE', 1, true) then
  redis.call('DEL', KEYS[5])  -- junk where the pulse belongs: replaced
  redis.call('XADD', KEYS[5], 'MAXLEN', '~', 10000, '*', 'o', KEYS[3])
end
redis.pcall('XADD', KEYS[4], 'MAXLEN', '~', ARGV[4], '*', 'session', ARGV[3])  -- junk queue: swept
return 1
