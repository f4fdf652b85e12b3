-- commit: the fenced end of one turn, atomically: append the new session rows, delete
-- the processed inbound entries, write the terminal reply (and a dead letter), update
-- the transient owner record, then select the next entry or release the lease.
-- KEYS[1] lease      KEYS[2] session hash   KEYS[3] inbound stream of the entries
-- KEYS[4] attempts hash of that stream      KEYS[5] out stream     KEYS[6] sessions index
-- KEYS[7] owner      KEYS[8] owners registry KEYS[9] pending  KEYS[10] leases registry
-- KEYS[11] dead-letter stream
-- KEYS[12..] stream triples for the next selection
-- ARGV[1] token  ARGV[2] entry ids to delete, space separated  ARGV[3] reply JSON ('' none)
-- ARGV[4] out stream MAXLEN  ARGV[5] session meta JSON ('' = nothing to persist)
-- ARGV[6] K  ARGV[7] owner op ('', 'set', 'del')  ARGV[8] worker id
-- ARGV[9] owner registry member  ARGV[10] owner ttl ms  ARGV[11] dead-letter JSON ('' none)
-- ARGV[12] '1' to select the next entry / release, '0' to stop after the commit
-- ARGV[13] n = number of rows  ARGV[14..13+n] rows (JSON)  ARGV[14+n..] triple members
-- returns {'lost'} | {'ok', version, <next_or_release result...>}
-- Idempotent: when the first entry is already gone (a client retry of a commit that
-- did run), nothing is written again.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return {'lost'} end
local n = tonumber(ARGV[13])
local first = string.match(ARGV[2], '%S+')
local applied = first and #redis.call('XRANGE', KEYS[3], first, first) == 0
local version = tonumber(redis.call('HGET', KEYS[2], 'version') or '0')

if not applied then
  if ARGV[5] ~= '' then
    local count = tonumber(redis.call('HGET', KEYS[2], 'count') or '0')
    for i = 1, n do
      redis.call('HSET', KEYS[2], 'm:' .. (count + i - 1), ARGV[13 + i])
    end
    redis.call('HSET', KEYS[2], 'count', count + n, 'meta', ARGV[5])
    version = redis.call('HINCRBY', KEYS[2], 'version', 1)
    redis.call('ZADD', KEYS[6], now_ms(), ARGV[6])
  end
  for id in string.gmatch(ARGV[2], '%S+') do
    redis.call('XDEL', KEYS[3], id)
    redis.call('HDEL', KEYS[4], id)
  end
  if ARGV[3] ~= '' then
    redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[4], '*', 'payload', ARGV[3])
  end
  if ARGV[11] ~= '' then
    redis.call('XADD', KEYS[11], 'MAXLEN', '~', ARGV[4], '*', 'entry', ARGV[11])
  end
  if ARGV[7] == 'set' then
    local ttl = tonumber(ARGV[10])
    redis.call('HSET', KEYS[7], 'worker', ARGV[8])
    redis.call('PEXPIRE', KEYS[7], ttl)
    redis.call('ZADD', KEYS[8], now_ms() + ttl, ARGV[9])
  elseif ARGV[7] == 'del' then
    redis.call('DEL', KEYS[7])
    redis.call('ZREM', KEYS[8], ARGV[9])
  end
end

if ARGV[12] ~= '1' then return {'ok', version} end
local nxt = next_or_release(KEYS[1], KEYS[9], KEYS[10], triples(12, 14 + n), ARGV[6])
return {'ok', version, unpack(nxt)}
