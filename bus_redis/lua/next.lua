-- next: select the next entry of a held session, or release the lease when none is left.
-- KEYS[1] lease  KEYS[2] pending  KEYS[3] lease registry of K's channel
-- KEYS[4..] stream keys, seven per stream (see _common.lua)
-- ARGV[1] token  ARGV[2] K  ARGV[3] ready MAXLEN  ARGV[4..] the streams' session keys
-- returns {'lost'} | {'entry', S, id, payload, attempts, covering op} | {'control', S, op}
--       | {'more', S...} | {'released'}
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return {'lost'} end
return next_or_release(KEYS[1], KEYS[2], KEYS[3], streams_of(4, 4), ARGV[2], ARGV[3])
