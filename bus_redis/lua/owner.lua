-- owner: renew or drop the owner record of a transient session.
-- KEYS[1] owner  KEYS[2] owners registry  KEYS[3] the session's event stream
-- KEYS[4] the session's private mark (content-free: it was opened private)
-- KEYS[5] the session's end (per-session mode, _events.lua)  KEYS[6] its inbound stream
-- ARGV[1] op ('renew' | 'drop' | 'abandon': delete the record, keep the registry entry |
-- 'open': only the provisional end, before the opening's commit writes the record)
-- ARGV[2] worker id  ARGV[3] registry member  ARGV[4] ttl ms
-- ARGV[5] how long the mark outlives the session, ms (0: no mark, per-session mode)
-- ARGV[6] how long its end is kept, ms (0: not kept, unified mode): a `new` marker
-- published before it was the private session's, a discard when reached later (by the
-- next holder after a handover: never a fold of the stored session beside it). While
-- the session is open its end is provisional, '<ms>|<member>', written by 'open' (before
-- the opening's commit writes the record) and kept by each renewal: its registry member,
-- with which a holder that reaches a `new` before the loss was reported reports it
-- first (owner_lost), so that the loss of a killed worker's session is an end too, and
-- when the opening's record would run out (ms), for an opening that came to nothing.
-- returns 1 done, 0 the record is not ours (renew: it expired or moved)
-- The mark is renewed with the record (a session that predates it gets one) and set to
-- outlive the session by ARGV[5] when it ends: a `new` reached on its stream later (a
-- crash between the record's drop and the marker's consumption, a frontend's /new after
-- the session was closed) is a discard, never a fold of the shared unified session.
-- The private session ends with 'drop' (discarded) and 'abandon' (closed, its worker
-- leaves): its events are deleted with it but for its error answers (_events.lua), so
-- none of its text outlives it in Redis (an XDEL'd event's bytes stay in the stream's
-- memory while its node has live entries), and the cancelled answer of a turn the end
-- cut, which its holder may commit just before this drop, stays for its asker. The
-- rewritten stream keeps its id floor (events written later get greater ids than any it
-- had, so a reader's position stays valid) and its TTL; with no TTL and nothing kept, it
-- goes.
local function end_events(key)
  if not keep_error_events(key, '-') then return end
  if redis.call('XLEN', key) == 0 and redis.call('PTTL', key) < 0 then redis.call('DEL', key) end
end

local function ended()
  write_private_end(KEYS[5], KEYS[6], ARGV[6], false)
end

local function mark(extra_ms)
  local ms = tonumber(ARGV[5]) or 0
  if ms > 0 then redis.call('SET', KEYS[4], '1', 'PX', ms + extra_ms) end
end

if ARGV[1] == 'open' then
  local keep = tonumber(ARGV[6]) or 0
  if keep > 0 then
    redis.call('SET', KEYS[5], (now_ms() + tonumber(ARGV[4])) .. '|' .. ARGV[3], 'PX', keep)
  end
  return 1
end
local cur = redis.call('HGET', KEYS[1], 'worker')
if ARGV[1] == 'abandon' then
  if cur == ARGV[2] then
    redis.call('DEL', KEYS[1])
    end_events(KEYS[3])
    mark(0)
    ended()
  end
  return 1
end
if ARGV[1] == 'drop' then
  if cur == ARGV[2] then
    redis.call('DEL', KEYS[1])
    end_events(KEYS[3])
    mark(0)
    ended()
  end
  -- the registry entry is the session's whoever holds it: a late drop of ours leaves
  -- another worker's (same key, channel and chat) alone
  if cur == ARGV[2] or not cur then redis.call('ZREM', KEYS[2], ARGV[3]) end
  return 1
end
if cur ~= ARGV[2] then return 0 end
local now = now_ms()
redis.call('PEXPIRE', KEYS[1], ARGV[4])
mark(tonumber(ARGV[4]))
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[4]), ARGV[3])
local keep = tonumber(ARGV[6]) or 0  -- its provisional end (the opening's) kept with it
if keep > 0 then redis.call('PEXPIRE', KEYS[5], keep) end
return 1
