-- acquire: take the lease of an effective session key K and select its first entry.
-- KEYS[1] lease        P:{K}:lease      "<epoch>|<worker>" with PX ttl
-- KEYS[2] epoch        P:{K}:epoch      fencing counter
-- KEYS[3] pending      P:{K}:pending    inbound streams the holder must drain
-- KEYS[4] owner        P:{K}:owner      transient owner record (hash: worker, ...)
-- KEYS[5] session      P:{K}:session    durable session hash (for its version)
-- KEYS[6] leases       P:leases         lease registry (K -> expiry ms)
-- KEYS[7] memory       P:memory         durable memory hash (for its version)
-- KEYS[8..]            stream triples: inbound stream, attempts hash, control flag
-- ARGV[1] worker id    ARGV[2] lease ttl ms    ARGV[3] K
-- ARGV[4] notified member S ('' when none)
-- ARGV[5] '1' when this worker holds K's transient session in memory (claims ownership)
-- ARGV[6] owner ttl ms
-- ARGV[7] '1' to select the first entry (or release at once), '0' to only take the lease
-- ARGV[8..] members (session keys) of the stream triples
-- returns {'forward', owner} | {'busy', holder}
--       | {'acquired', token, session version, memory version, <next_or_release result...>}
local owner = redis.call('HGET', KEYS[4], 'worker')
if owner and owner ~= ARGV[1] then return {'forward', owner} end
if ARGV[4] ~= '' then redis.call('SADD', KEYS[3], ARGV[4]) end
local holder = redis.call('GET', KEYS[1])
if holder then return {'busy', holder} end
if ARGV[5] == '1' and not owner then
  redis.call('HSET', KEYS[4], 'worker', ARGV[1])
  redis.call('PEXPIRE', KEYS[4], ARGV[6])
end
local epoch = redis.call('INCR', KEYS[2])
local token = epoch .. '|' .. ARGV[1]
local ttl = tonumber(ARGV[2])
redis.call('SET', KEYS[1], token, 'PX', ttl)
redis.call('ZADD', KEYS[6], now_ms() + ttl, ARGV[3])
local version = redis.call('HGET', KEYS[5], 'version') or '0'
local memory = redis.call('HGET', KEYS[7], 'version') or '0'
if ARGV[7] ~= '1' then return {'acquired', token, version, memory} end
local nxt = next_or_release(KEYS[1], KEYS[3], KEYS[6], triples(8, 8), ARGV[3])
return {'acquired', token, version, memory, unpack(nxt)}
