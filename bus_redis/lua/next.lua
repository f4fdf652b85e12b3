-- next: select the next entry of a held session, or release the lease when none is left.
-- KEYS[1] lease  KEYS[2] pending  KEYS[3] leases registry
-- KEYS[4..] stream triples: inbound stream, attempts hash, control flag
-- ARGV[1] token  ARGV[2] K  ARGV[3..] members of the stream triples
-- returns {'lost'} | {'entry', member, id, payload, attempts, flag} | {'more', members...} | {'released'}
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return {'lost'} end
return next_or_release(KEYS[1], KEYS[2], KEYS[3], triples(4, 3), ARGV[2])
