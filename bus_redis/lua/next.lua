-- next: select the next entry of a held session, or release the lease when none is left.
-- KEYS[1] lease  KEYS[2] pending  KEYS[3] lease registry of K's channel
-- KEYS[4..] stream keys, seven per stream (see _common.lua)
-- ARGV[1] token  ARGV[2] K  ARGV[3] ready MAXLEN
-- ARGV[4] the stream of a new or delete marker the holder has acted on ('' none; one of
--         the streams below)  ARGV[5] that marker's id: consumed first
-- ARGV[6..] the streams' session keys
-- returns {'lost'} | {'entry', S, id, payload, attempts, covering op}
--       | {'control', S, op, kept marker id or '', its deliveries} | {'more', S...}
--       | {'released'}
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return {'lost'} end
local streams = streams_of(4, 6)
if ARGV[4] ~= '' then
  for _, s in ipairs(streams) do
    if s[6] == ARGV[4] then consume_marker(s, ARGV[5]) end
  end
end
return next_or_release(KEYS[1], KEYS[2], KEYS[3], streams, ARGV[2], ARGV[3])
