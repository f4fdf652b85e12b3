-- compact: rewrite a private session's event stream with only its live events, so the
-- bytes of events its frontend read and deleted (XDEL only marks them while their node
-- has live entries) are gone from memory and snapshots. Bounded: skipped above ARGV[2].
-- KEYS[1] lease  KEYS[2] the session's event stream
-- ARGV[1] token  ARGV[2] max live events to rewrite
-- returns the number of events rewritten, -1 when skipped (lease lost, too many, junk)
-- Ids are kept, and so is the stream's id floor (the next event gets a greater id than
-- any the stream ever had, so a reader's position stays valid); the TTL is kept.
local unpack = unpack or table.unpack
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
local t = redis.call('TYPE', KEYS[2])
t = t.ok or t
if t ~= 'stream' then return -1 end
local n = redis.call('XLEN', KEYS[2])
if n == 0 then return 0 end  -- every node was freed with its last entry: nothing to do
if n > tonumber(ARGV[2]) then return -1 end
local ttl = redis.call('PTTL', KEYS[2])
local live = redis.call('XRANGE', KEYS[2], '-', '+')
local floor = redis.call('XADD', KEYS[2], '*', '_', '')  -- greater than every id so far
redis.call('DEL', KEYS[2])
for _, e in ipairs(live) do
  redis.call('XADD', KEYS[2], e[1], unpack(e[2]))
end
redis.call('XADD', KEYS[2], floor, '_', '')
redis.call('XDEL', KEYS[2], floor)
if ttl > 0 then redis.call('PEXPIRE', KEYS[2], ttl) end  -- never extended
return n
