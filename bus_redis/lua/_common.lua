-- Shared prelude, prepended to the scripts that select the next entry or release a lease.
-- Not a script of its own. Stream "triples" are passed as KEYS (inbound stream, attempts
-- hash, control flag) with the matching session key (pending-set member) in ARGV.
local unpack = unpack or table.unpack

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- stream ids are "<ms>-<seq>"
local function id_less(a, b)
  local am, as = string.match(a, '(%d+)-(%d+)')
  local bm, bs = string.match(b, '(%d+)-(%d+)')
  am, bm = tonumber(am), tonumber(bm)
  if am ~= bm then return am < bm end
  return tonumber(as) < tonumber(bs)
end

-- streams: list of {stream, attempts, flag, member}
local function triples(first_key, first_arg)
  local out = {}
  local n = 0
  for i = first_key, #KEYS, 3 do
    out[#out + 1] = {KEYS[i], KEYS[i + 1], KEYS[i + 2], ARGV[first_arg + n]}
    n = n + 1
  end
  return out
end

-- The oldest unprocessed entry over the given streams; counts one delivery attempt.
local function select_next(streams)
  local best, best_entry
  for i, s in ipairs(streams) do
    local e = redis.call('XRANGE', s[1], '-', '+', 'COUNT', 1)[1]
    if e and (not best_entry or id_less(e[1], best_entry[1])) then
      best, best_entry = i, e
    end
  end
  if not best then return nil end
  local s = streams[best]
  local attempts = redis.call('HINCRBY', s[2], best_entry[1], 1)
  local flag = redis.call('GET', s[3]) or ''
  local payload = ''
  local fields = best_entry[2]
  for j = 1, #fields, 2 do
    if fields[j] == 'payload' then payload = fields[j + 1] end
  end
  return {'entry', s[4], best_entry[1], payload, attempts, flag}
end

-- Nothing left in the known streams: forget them; release the lease only when the
-- pending set is empty (a stream notified meanwhile keeps the lease: 'more').
local function try_release(lease, pending, registry, streams, key)
  for _, s in ipairs(streams) do
    if redis.call('XLEN', s[1]) == 0 then
      redis.call('SREM', pending, s[4])
      redis.call('DEL', s[1], s[2])
    end
  end
  local left = redis.call('SMEMBERS', pending)
  if #left > 0 then return {'more', unpack(left)} end
  redis.call('DEL', lease)
  redis.call('ZREM', registry, key)
  return {'released'}
end

local function next_or_release(lease, pending, registry, streams, key)
  return select_next(streams) or try_release(lease, pending, registry, streams, key)
end
