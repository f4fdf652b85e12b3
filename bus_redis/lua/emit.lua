-- emit: a fenced non-terminal outbound event (progress, delta).
-- KEYS[1] lease  KEYS[2] out stream
-- ARGV[1] token  ARGV[2] payload JSON  ARGV[3] MAXLEN
-- returns the entry id, or false when the lease is lost
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return false end
return redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', 'payload', ARGV[2])
