-- interrupts: the messages that follow the interrupt markers a worker heard for a running
-- turn, for its scope check (worker/runtime/interrupts.py), read in one bounded step.
-- KEYS[1] inbound stream S
-- ARGV[1] the earliest interrupt marker heard  ARGV[2] the latest one heard
-- ARGV[3] entries to read at most from the earliest
-- returns the id of the last entry the walk from the earliest marker reached ('' none:
-- the marker is gone), then the payloads ('' for an entry that has none) of the entries
-- right after an interrupt marker: from the earliest marker, within ARGV[3] entries and
-- SCAN_BYTES (entries read one at a time: a flood of big entries costs Redis and the
-- worker no more), then the one after the latest marker (the owner's, heard last). Only
-- these payloads leave Redis, each once. (Every marker from the earliest to the entry
-- reached was read: the worker does not read them again.)
local out, given = {}, {}
local function give(e)
  if e and not given[e[1]] then
    given[e[1]] = true
    out[#out + 1] = field(e[2], 'payload') or ''
  end
end

local function at(id)
  if not string.match(id, '^%d+%-%d+$') then return nil end
  local r = redis.pcall('XRANGE', KEYS[1], id, id)
  if type(r) ~= 'table' or r.err then return nil end
  return r[1]
end

local limit = tonumber(ARGV[3]) or 0
local e, read, bytes = at(ARGV[1]), 0, 0
local reached = e and e[1] or ''
while e and read < limit and bytes < SCAN_BYTES do
  local nxt = entry_after(KEYS[1], e[1])
  if nxt and field(e[2], 'control') == 'interrupt' then give(nxt) end
  if nxt then
    read, bytes, reached = read + 1, bytes + entry_bytes(nxt), nxt[1]
  end
  e = nxt
end
local latest = at(ARGV[2])
if latest and field(latest[2], 'control') == 'interrupt' then
  give(entry_after(KEYS[1], latest[1]))
end
table.insert(out, 1, reached)
return out
