-- emit: a fenced non-terminal event (progress, delta) on the session's event stream.
-- KEYS[1] lease  KEYS[2] out stream P:{C}:out:S  KEYS[3] the pulse of C
-- ARGV[1] token  ARGV[2] payload JSON (carries a per-turn sequence number)  ARGV[3] MAXLEN
-- ARGV[4] stream ttl ms
-- returns the entry id, or false when the lease is lost. Idempotent: a client retry of a
-- call that did run finds its event already last and adds nothing.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return false end
local t = redis.call('TYPE', KEYS[2])
t = t.ok or t
if t ~= 'stream' and t ~= 'none' then redis.call('DEL', KEYS[2]) end  -- junk a frontend wrote
local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)[1]
if last and last[2][2] == ARGV[2] then return last[1] end
local id = redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', 'payload', ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
local pulsed = redis.pcall('XADD', KEYS[3], 'MAXLEN', '~', 10000, '*', 'o', KEYS[2])  -- PULSE_MAXLEN
if type(pulsed) == 'table' and pulsed.err and string.find(tostring(pulsed.err), 'WRONGTYPE', 1, true) then
  redis.call('DEL', KEYS[3])  -- junk where the pulse belongs: replaced
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', 10000, '*', 'o', KEYS[2])
end
return id
