-- tidy: forget a session stream with nothing queued (the stranded-stream sweep).
-- KEYS[1] inbound stream S  KEYS[2] attempts S  KEYS[3] control hint S  KEYS[4] lease S
-- KEYS[5] owner S  KEYS[6] queued index of S's channel
-- ARGV[1] S
-- returns 1 when S was forgotten (its empty or junk stream, memos, hint and index entry
-- deleted), 0 when it has entries, a holder or an owner (then nothing is touched)
local t = redis.call('TYPE', KEYS[1])
t = t.ok or t
if t == 'stream' and redis.call('XLEN', KEYS[1]) > 0 then return 0 end
if redis.call('EXISTS', KEYS[4]) == 1 or redis.call('EXISTS', KEYS[5]) == 1 then return 0 end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
redis.call('ZREM', KEYS[6], ARGV[1])
return 1
