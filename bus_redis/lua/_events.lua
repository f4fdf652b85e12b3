-- Shared prelude of the scripts that end a session's events (owner, owner_lost, delete).
-- Not a script of its own.
local ERROR_PREFIX = '{"v":2,"type":"error",'  -- how a worker writes an error event

-- Rewrite event stream `key` to hold only its error events with ids from `from` ('-': all)
-- (no text of the session: cancelled, session_not_active, ...; a message keeps its one
-- terminal event), ids kept and its last id kept as the stream's floor (a reader's
-- position stays valid), its expiry kept, the newest 1,000 entries looked at (the
-- stream's MAXLEN). An event's
-- type is read from the start of its payload, where workers write it (frontends cannot
-- write events): metadata copied from a message cannot pass for it. A key of another
-- type is deleted. Returns whether a stream is left.
local function keep_error_events(key, from)
  local t = redis.call('TYPE', key)
  t = t.ok or t
  if t ~= 'stream' then
    redis.call('DEL', key)
    return false
  end
  local ttl = redis.call('PTTL', key)
  local floor = redis.call('XADD', key, '*', '_', '')
  local kept = {}  -- newest first: the newest 1,000 entries are looked at
  for _, e in ipairs(redis.call('XREVRANGE', key, '+', from, 'COUNT', 1000)) do
    local f = e[2]
    for i = 1, #f - 1, 2 do
      if f[i] == 'payload' and string.sub(f[i + 1], 1, #ERROR_PREFIX) == ERROR_PREFIX then
        kept[#kept + 1] = {e[1], f[i + 1]}
      end
    end
  end
  redis.call('DEL', key)
  for i = #kept, 1, -1 do redis.call('XADD', key, kept[i][1], 'payload', kept[i][2]) end
  redis.call('XADD', key, floor, '_', '')
  redis.call('XDEL', key, floor)
  if ttl > 0 then redis.call('PEXPIRE', key, ttl) end  -- as long-lived as it was
  return true
end

-- Per-session mode: write where private session S ended into `key` (Keys.private_end),
-- kept `keep` ms (0: not kept, unified mode): '<ms>:<id>', Redis' time and the id of the
-- last entry of S's inbound stream `inbound` ('0-0' when none waits). A `new` marker
-- published in an earlier millisecond, or in that one at or before the id, was published
-- while S was open (S's own, a discard whoever reaches it later); a later one, after S
-- ended (the stored session's): a marker in the very millisecond S ended is told apart,
-- and a frontend's junk id (the maximal one, a day ahead) moves no end. `reported` (a
-- loss report, whose session's record ran out): a provisional end still ahead of now is
-- a newer opening's on the key (reported between its opening and its commit), left to it.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function write_private_end(key, inbound, keep, reported)
  keep = tonumber(keep) or 0
  if keep <= 0 then return end
  local now = now_ms()
  local cur = reported and redis.call('GET', key)
  if cur then
    local ahead = tonumber(string.match(cur, '^(%d+)|'))
    if ahead and ahead > now then return end
  end
  local last = redis.pcall('XREVRANGE', inbound, '+', '-', 'COUNT', 1)
  local id = '0-0'
  if type(last) == 'table' and not last.err and last[1] then id = last[1][1] end
  redis.call('SET', key, now .. ':' .. id, 'PX', keep)
end
