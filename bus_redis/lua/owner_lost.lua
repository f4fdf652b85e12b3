-- owner_lost: a transient session's owner stopped renewing: tell the frontend once and
-- re-notify the session so that queued messages are answered session_not_active.
-- KEYS[1] owner  KEYS[2] owners registry  KEYS[3] out stream  KEYS[4] ready stream
-- ARGV[1] registry member  ARGV[2] session_lost event JSON ('' = no frontend to tell)  ARGV[3] session key K  ARGV[4] MAXLEN
-- returns 1 when this call reported the loss, 0 otherwise
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
if redis.call('ZREM', KEYS[2], ARGV[1]) == 0 then return 0 end
if ARGV[2] ~= '' then
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[4], '*', 'payload', ARGV[2])
end
redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[4], '*', 'session', ARGV[3], 'effective', '1')
return 1
