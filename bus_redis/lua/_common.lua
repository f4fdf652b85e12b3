-- Shared prelude, prepended to the scripts that select the next entry or release a lease.
-- Not a script of its own. Each inbound stream S is passed as seven KEYS (inbound stream,
-- attempts hash, control hint, owner record, ready stream of S's channel, S's own lease,
-- queued index of S's channel) with S itself in ARGV. An entry has a field `payload` (a
-- message or an op) or `control` (a stop, discard, new or delete marker published by the
-- frontend: it covers exactly the entries before it).
-- Work per call is bounded in entries and in bytes read (entries are read one at a time).
local unpack = unpack or table.unpack
local MARKER_SCAN = 256  -- entries read per call while looking for a control marker
local SCAN_BYTES = 1048576  -- ... or fewer, once this many bytes were read
local HEAD_BATCH = 64  -- control markers consumed per call at the head of a stream
local RANK = {discard = 1, new = 2, delete = 3}  -- markers reported to the holder

local clock  -- Redis time, read once per script call (a script runs atomically anyway)
local function now_ms()
  if not clock then
    local t = redis.call('TIME')
    clock = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return clock
end

-- Stream ids are "<ms>-<seq>", each part up to 2^64 - 1 (a frontend may XADD explicit
-- ids): compared as digit strings (Redis writes no leading zeros), never as Lua numbers,
-- which are doubles and lose precision above 2^53.
local function num_less(a, b)
  if #a ~= #b then return #a < #b end
  return a < b
end

local function id_less(a, b)
  local am, as = string.match(a, '(%d+)-(%d+)')
  local bm, bs = string.match(b, '(%d+)-(%d+)')
  if am ~= bm then return num_less(am, bm) end
  return num_less(as, bs)
end

-- The entry after `id` (nil at the end). At the maximal id there is nothing after it, and
-- `XRANGE (<max>` is an error: a frontend may XADD an entry at that id.
local MAX_ID = '18446744073709551615-18446744073709551615'
local function entry_after(key, id)
  if id == MAX_ID then return nil end
  local r = redis.pcall('XRANGE', key, '(' .. id, '+', 'COUNT', 1)
  if type(r) == 'table' and r.err then
    if string.find(r.err, 'WRONGTYPE', 1, true) then  -- junk a frontend wrote
      redis.call('DEL', key)
      return nil
    end
    return redis.call('XRANGE', key, '(' .. id, '+', 'COUNT', 1)[1]  -- raises it
  end
  return r[1]
end

local function entry_bytes(e)
  local n = #e[1]
  for _, v in ipairs(e[2]) do n = n + #v end
  return n
end

-- A key a frontend may write (hint, events, inbound stream) that has another type than the
-- worker expects is junk: it is deleted instead of failing the script halfway. `safe`
-- runs a command; on an error it deletes the key and answers `empty` (a wrong type, an
-- events stream at the last possible id), except on a full Redis: the key is no junk, and
-- the error is raised (a script's first write is refused past maxmemory).
local function safe(empty, cmd, key, ...)
  local r = redis.pcall(cmd, key, ...)
  if type(r) == 'table' and r.err then
    if string.find(tostring(r.err), 'OOM', 1, true) == 1 then
      return redis.call(cmd, key, ...)  -- raises it
    end
    redis.call('DEL', key)
    return empty
  end
  return r
end

local function field(fields, name)
  for j = 1, #fields, 2 do
    if fields[j] == name then return fields[j + 1] end
  end
  return nil
end

-- streams: list of {in, attempts, hint, owner, ready, member, lease of S, queued index};
-- a caller that knows a stream holds nothing sets its `empty` (its head is not read), and
-- its `deleted` when it deleted the stream, its attempts and its hint already
-- A private session's inbound stream rewritten with only its live entries (at most `max`;
-- more: left as it is until its queue drains): XDEL only marks an entry while its node
-- has live ones, so a processed message's text stayed in memory and in snapshots while
-- messages waited behind it. Ids, the id floor (the next entry's id stays greater than
-- any so far) and the TTL are kept.
local SHED_MAX_BYTES = 1048576  -- copied at most by one rewrite (else left as it is)
local SHED_MAX_VALUES = 256  -- an entry's fields and values (a frontend's wide entry: left)
local function shed_deleted(key, max)
  local live = redis.call('XRANGE', key, '-', '+', 'COUNT', max + 1)
  if #live == 0 or #live > max then return end
  local bytes = 0
  for _, e in ipairs(live) do
    if #e[2] > SHED_MAX_VALUES then return end
    for _, v in ipairs(e[2]) do bytes = bytes + #v end
    if bytes > SHED_MAX_BYTES then return end
  end
  local floor = redis.pcall('XADD', key, '*', '_', '')
  if type(floor) == 'table' then return end  -- an entry at the maximal id: left as it is
  local ttl = redis.call('PTTL', key)
  redis.call('DEL', key)
  for _, e in ipairs(live) do redis.call('XADD', key, e[1], unpack(e[2])) end
  redis.call('XADD', key, floor, '_', '')
  redis.call('XDEL', key, floor)
  if ttl > 0 then redis.call('PEXPIRE', key, ttl) end
end

local function streams_of(first_key, first_arg)
  local out = {}
  local n = 0
  for i = first_key, #KEYS, 7 do
    out[#out + 1] = {KEYS[i], KEYS[i + 1], KEYS[i + 2], KEYS[i + 3], KEYS[i + 4], ARGV[first_arg + n],
                     KEYS[i + 5], KEYS[i + 6]}
    n = n + 1
  end
  return out
end

-- The op of the first control marker after entry `id` (an `interrupt` marker cancels only
-- a running turn, over pub/sub: it covers nothing queued and is read past); '' when none is queued; nil when
-- not known yet (MARKER_SCAN entries were read without reaching a marker or the end:
-- the caller answers 'again' and the next call reads on). Looked for only while the hint
-- says markers may be queued. Two memos in the attempts hash make each entry read once,
-- however often a frontend re-sets the hint: `_mark` ("<id> <op>", the first marker) and
-- `_scan` (an id: no marker is queued up to it; entries are only ever appended after it).
local function covering_op(s, id)
  local hint = tonumber(safe(false, 'GET', s[3]) or '0') or 1
  if hint <= 0 then return '' end
  local mark = redis.call('HGET', s[2], '_mark')
  if mark then
    local mid, mop = string.match(mark, '(%S+) (%S+)')
    if mid and id_less(id, mid) then return mop end
  end
  local from = id
  local scanned = redis.call('HGET', s[2], '_scan')
  if scanned and string.match(scanned, '^%d+%-%d+$') and id_less(from, scanned) then
    from = scanned
  end
  local read, bytes, last = 0, 0, nil
  while read < MARKER_SCAN and bytes < SCAN_BYTES do
    local e = entry_after(s[1], from)
    if not e then break end
    local op = field(e[2], 'control')
    if op and op ~= 'interrupt' then  -- an interrupt covers no queued entry
      redis.call('HSET', s[2], '_mark', e[1] .. ' ' .. op)
      return op
    end
    read, bytes, last, from = read + 1, bytes + entry_bytes(e), e[1], e[1]
  end
  if last then redis.call('HSET', s[2], '_scan', last) end
  if read == MARKER_SCAN or bytes >= SCAN_BYTES then return nil end
  redis.call('DEL', s[3])  -- no marker is queued at all
  return ''
end

-- Consume control markers at the head of a stream (everything before them is done),
-- reading at most HEAD_BATCH per call. A new or delete marker is not consumed here: its
-- effect (the session folded into memory, the stored session deleted) is the holder's to
-- do, so the marker stays at the head until the holder's next call consumes it
-- (`consume_marker`, next.lua): a holder that dies first leaves it for the next one. Of a
-- run of markers, the last delete is the one kept (a delete also does what new and
-- discard do), else the last new (two news in a row do what the second does); the
-- markers before it are consumed, so a run of markers is read once, not once per marker.
-- Returns the oldest real entry (or nil), the op reached (discard, new or delete; nil
-- none), the id of the marker kept ('' none), and whether the batch ran out before a real
-- entry or the end (the caller answers 'again').
local function head(s)
  local run, ops, keep, entry, bytes = {}, {}, nil, nil, 0
  while #run < HEAD_BATCH and bytes < SCAN_BYTES do  -- (markers a frontend padded: bytes)
    local e = entry_after(s[1], run[#run] or '0-0')
    if not e then break end
    local op = field(e[2], 'control')
    if not op then entry = e break end
    bytes = bytes + entry_bytes(e)
    run[#run + 1] = e[1]
    ops[#run] = op
    if op == 'delete' or (op == 'new' and (not keep or ops[keep] == 'new')) then
      keep = #run
    end
  end
  local upto = keep and keep - 1 or #run
  local discarded = nil
  local hinted = 0  -- markers the hint counts (an interrupt marker is not counted)
  for i = 1, upto do
    if ops[i] ~= 'interrupt' then hinted = hinted + 1 end
    if (RANK[ops[i]] or 0) > (RANK[discarded] or 0) then discarded = ops[i] end
  end
  if upto > 0 then
    redis.call('XDEL', s[1], unpack(run, 1, upto))
    redis.call('HDEL', s[2], '_mark')
  end
  if hinted > 0 then
    local n = safe(false, 'DECRBY', s[3], hinted)  -- a hint that is no integer is junk
    if not n or n <= 0 then redis.call('DEL', s[3]) end
  end
  if keep then return nil, ops[keep], run[keep], false end
  return entry, discarded, '', (not entry and (#run == HEAD_BATCH or bytes >= SCAN_BYTES))
end

-- The new or delete marker `id` at the head of stream s, acted on by the holder: consumed
-- (once: a client retry finds it gone and counts nothing twice).
local function consume_marker(s, id)
  if redis.call('XDEL', s[1], id) == 0 then return end
  redis.call('HDEL', s[2], id, '_mark')
  local n = safe(false, 'DECRBY', s[3], 1)
  if not n or n <= 0 then redis.call('DEL', s[3]) end
end

-- Whether a stream folded under K (S ~= K) must be left alone: it is no longer pending
-- for K, or it became a private session (owner record) or has a holder of its own (lease
-- of S). It then leaves K's pending set, and a private one with no holder is re-notified so
-- that its owner serves it: one stream is never drained under two leases.
local function leave_alone(s, key, pending, maxlen)
  if s[6] == key then return false end
  if redis.call('SISMEMBER', pending, s[6]) == 0 then return true end
  local held = redis.call('EXISTS', s[7]) == 1
  if not held and redis.call('EXISTS', s[4]) == 0 then return false end
  redis.call('SREM', pending, s[6])
  if not held then  -- a ready queue that takes no entry: the queued-index sweep finds S
    redis.pcall('XADD', s[5], 'MAXLEN', '~', maxlen, '*', 'session', s[6])
  end
  return true
end

-- The oldest unprocessed entry over the given streams; counts one delivery attempt.
-- {'again'} when a bounded step (markers consumed, a marker scan) left work for the next call.
local function select_next(streams, key, pending, maxlen)
  local best, best_entry
  for i, s in ipairs(streams) do
    if leave_alone(s, key, pending, maxlen) then
      s.skip = true
    else
      local e, discarded, kept, more = nil, nil, '', false
      if not s.empty then e, discarded, kept, more = head(s) end
      if discarded then  -- a kept marker counts its deliveries as an entry does
        local attempts = kept ~= '' and redis.call('HINCRBY', s[2], kept, 1) or 0
        return {'control', s[6], discarded, kept, attempts}
      end
      if more then return {'again'} end
      if e and (not best_entry or id_less(e[1], best_entry[1])) then
        best, best_entry = i, e
      end
    end
  end
  if not best then return nil end
  local s = streams[best]
  local op = covering_op(s, best_entry[1])
  if op == nil then return {'again'} end
  local attempts = redis.call('HINCRBY', s[2], best_entry[1], 1)
  local payload = field(best_entry[2], 'payload') or ''
  return {'entry', s[6], best_entry[1], payload, attempts, op}
end

-- Nothing left in the known streams (select_next found every stream it did not leave
-- alone empty: its head read met the end): forget them; release the lease only when the
-- pending set is empty (a stream notified meanwhile keeps the lease: 'more'; a key that
-- is its own stream only has one when streams are folded under it: acquire.lua).
local PENDING_BATCH = 64
local function try_release(lease, pending, registry, key, streams)
  local emptied = {}
  for _, s in ipairs(streams) do
    if not s.skip then
      emptied[s[6]] = true
      if not s.deleted then redis.call('DEL', s[1], s[2], s[3]) end
      redis.call('ZREM', s[8], s[6])
    end
  end
  -- the streams left (PENDING_BATCH at most: a frontend may notify any number of chats
  -- folded under one key; the holder drains these, and the next 'more' names others)
  local n, left = 0, {}
  for _ in pairs(emptied) do n = n + 1 end
  for _, m in ipairs(redis.call('SRANDMEMBER', pending, PENDING_BATCH + n)) do
    if not emptied[m] and #left < PENDING_BATCH then left[#left + 1] = m end
  end
  if #left > 0 then
    for m in pairs(emptied) do redis.call('SREM', pending, m) end
    return {'more', unpack(left)}
  end
  redis.call('DEL', lease, pending)  -- (the emptied streams' members go with it)
  redis.call('ZREM', registry, key)
  return {'released'}
end

-- registry: P:{C}:leases of K's channel (K -> lease expiry ms), swept for dead holders
local function next_or_release(lease, pending, registry, streams, key, maxlen)
  return select_next(streams, key, pending, maxlen)
    or try_release(lease, pending, registry, key, streams)
end
