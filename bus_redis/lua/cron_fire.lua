-- cron_fire: deliver one firing of a schedule into its session's stream, exactly once:
-- whichever worker's job or sweep comes first moves the schedule on; the others find it
-- moved and do nothing. The message is published as a frontend publishes one (stream,
-- queued index, ready queue), so order, leases and scope apply as to any message.
-- KEYS[1] channel's schedule definitions  KEYS[2] channel's due index  KEYS[3] the
-- session's schedules  KEYS[4] the session's inbound stream  KEYS[5] channel's queued
-- index  KEYS[6] channel's ready queue  KEYS[7] the session hash (of its effective key)
-- KEYS[8] the lease of its effective key  KEYS[9] the tool journal of its effective key
-- KEYS[10] channel's schedule id -> scope  KEYS[11] channel's scope -> schedules it holds
-- KEYS[12] the owner record of its session's own key (a private session is open on the
-- stream KEYS[4]; in unified mode that is the chat's key, not the effective one)
-- ARGV[1] schedule id  ARGV[2] the firing (ms: its score in the due index)
-- ARGV[3] the message (JSON)  ARGV[4] the next firing (ms, later than ARGV[2]; '' when
-- this is the last)  ARGV[5] session key  ARGV[6] MAXLEN of the ready queue
-- ARGV[7] when to try again a firing that cannot be delivered now (ms, later than ARGV[2])
-- ARGV[8] '1': the session is folded into another (unified mode: KEYS[7..9] are the
-- shared session's), '' otherwise
-- returns 1 fired, 0 not due then any more (fired already, moved or removed), -2 moved
-- on without a message (the stream takes no entry: another type, or the maximal id;
-- a frontend's junk), -3 not now, put off to ARGV[7]
-- (the session's first turn, which added it, is still running, or its worker died and
-- its entry waits in the stream to be run again, its tool journal holding the call; or
-- a private session is open on its key, or its opening waits in the stream, whose
-- conversation it must not run in, and a firing delivered now would be refused and lost). A firing put off moves in the due
-- index, so that it never holds up the channel's other overdue firings.
-- A session that was never stored (the turn that added the schedule was not committed,
-- and nothing of it waits to be run again) loses the schedule here: a firing must not
-- create a session of its own. Not so a chat folded into the unified session (one owner,
-- one scope): that session is deleted by any chat's `new` and by the idle prune while
-- the chat keeps its schedules, and the firing starts it again.
local due = redis.call('ZSCORE', KEYS[2], ARGV[1])
if not due or tonumber(due) ~= tonumber(ARGV[2]) then return 0 end
local function drop()
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('HDEL', KEYS[1], ARGV[1])
  redis.call('SREM', KEYS[3], ARGV[1])
  forget_cron_scope(KEYS[10], KEYS[11], ARGV[1])
end
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then
  redis.call('ZREM', KEYS[2], ARGV[1])
  return 0
end
local function later()
  redis.call('ZADD', KEYS[2], ARGV[7], ARGV[1])
  return -3
end
-- a private session open on its key, or its opening waiting (_openings.lua)
if private_waits(KEYS[12], KEYS[4]) then return later() end
if redis.call('EXISTS', KEYS[7]) == 0 then
  if redis.call('EXISTS', KEYS[8]) == 1 then return later() end
  -- a turn of this session whose worker died: its entry still waits in the stream, and
  -- its journal holds its calls (a dead-lettered or cancelled entry is gone from it)
  local held = redis.call('HGET', KEYS[9], 'entry')
  if held and string.sub(held, 1, #ARGV[5] + 1) == ARGV[5] .. '|' then
    local id = string.sub(held, #ARGV[5] + 2)
    local found = redis.pcall('XRANGE', KEYS[4], id, id)
    if type(found) == 'table' and not found.err and #found > 0 then return later() end
  end
  if ARGV[8] ~= '1' then
    drop()
    return 0
  end
end
if ARGV[4] ~= '' and tonumber(ARGV[4]) <= tonumber(ARGV[2]) then
  return redis.error_reply('cron_fire: the next firing must be later than this one')
end
local added = redis.pcall('XADD', KEYS[4], '*', 'payload', ARGV[3])
local fired = 1
if type(added) == 'table' and added.err then
  local err = tostring(added.err)
  -- the stream itself takes no entry, ever (another type; the maximal id): move on
  if not (string.find(err, 'WRONGTYPE', 1, true) or string.find(err, 'equal or smaller', 1, true)
      or string.find(err, 'exhausted', 1, true)) then
    return redis.error_reply(err)  -- e.g. OOM: nothing moved, tried again later
  end
  fired = -2
else
  -- the message is in the stream: the firing has happened. A ready queue (or index) of
  -- the frontend's that refuses the notification must not undo that, nor make the next
  -- sweep add the message again: the stranded-stream sweep finds the stream instead
  redis.pcall('ZADD', KEYS[5], 'NX', 0, ARGV[5])
  redis.pcall('XADD', KEYS[6], 'MAXLEN', '~', ARGV[6], '*', 'session', ARGV[5])
end
if ARGV[4] == '' then
  drop()
else
  redis.call('ZADD', KEYS[2], ARGV[4], ARGV[1])
end
return fired
