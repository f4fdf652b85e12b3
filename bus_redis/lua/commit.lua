-- commit: the fenced end of one turn, atomically: append the new session rows, delete
-- the processed inbound entries, write the terminal event (and a dead letter), update
-- the transient owner record, then select the next entry or release the lease.
-- KEYS[1] lease K         KEYS[2] session hash K    KEYS[3] inbound stream S
-- KEYS[4] attempts S      KEYS[5] out stream S      KEYS[6] channel's sessions index (of K)
-- KEYS[7] scope index (joined when the hash is created)  KEYS[8] owner S
-- KEYS[9] owners registry (of S)
-- KEYS[10] pending K      KEYS[11] dead letters (of S's channel)
-- KEYS[12] lease registry of K's channel  KEYS[13] tool journal K
-- KEYS[14] the pulse of S's channel (gets KEYS[5]'s name when the event is written)
-- KEYS[15..] stream keys for the next selection, seven per stream (see _common.lua)
-- ARGV[1] token  ARGV[2] entry ids to delete, space separated  ARGV[3] event JSON ('' none)
-- ARGV[4] MAXLEN of streams  ARGV[5] out stream ttl ms  ARGV[6] session meta JSON ('' = nothing
-- to persist)  ARGV[7] K  ARGV[8] owner op ('', 'set', 'del')  ARGV[9] worker id
-- ARGV[10] owner registry member  ARGV[11] owner ttl ms  ARGV[12] dead-letter JSON ('' none)
-- ARGV[13] '1' to select the next entry / release, '0' to stop after the commit; then 'j':
--          the turn kept a tool journal, dropped now that it is answered ('-' none); then
--          'p': a private session's (its stream is rewritten when messages wait behind the
--          processed ones: shed_deleted)
-- ARGV[14] generation for a session hash this commit creates
-- ARGV[15] an entry id ('' none): a payload entry after it in S refuses the commit, nothing
--          written (a message arrived that may join the turn, which then goes on: the
--          turn's last read of its stream, done here instead of in a round trip of its own)
-- ARGV[16] n = number of rows  ARGV[17..16+n] rows (JSON)  ARGV[17+n..] stream session keys
-- returns {'lost'} | {'late'} | {'ok', version, generation, <next_or_release result...>}
-- Idempotent: when the first entry is already gone (a client retry of a commit that
-- did run), nothing is written again.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return {'lost'} end
local n = tonumber(ARGV[16])
local first = string.match(ARGV[2], '%S+')
-- One read for the usual case, `first` at the head of S: not applied yet, and the entry
-- after it (the late check's, when the turn read nothing past it; none: S is empty once
-- `first` is deleted, and its head is not read again). Otherwise `first` is looked up.
local applied, at_head, after_first = false, false, nil
if first then
  local top = safe({}, 'XRANGE', KEYS[3], '-', '+', 'COUNT', 2)
  if top[1] and top[1][1] == first then
    at_head, after_first = true, top[2]
  else
    applied = #safe({}, 'XRANGE', KEYS[3], first, first) == 0
  end
end
local emptied, sole = false, false
if not applied then
  local later = nil
  if at_head and ARGV[15] == first then
    later = after_first
  elseif ARGV[15] ~= '' then
    later = entry_after(KEYS[3], ARGV[15])
  end
  if later and field(later[2], 'payload') then return {'late'} end
  emptied = at_head and ARGV[2] == first and after_first == nil
end
local s = redis.call('HMGET', KEYS[2], 'version', 'gen', 'count')
local version, gen = tonumber(s[1] or '0'), s[2] or ''

if not applied then
  if ARGV[6] ~= '' then
    local count = tonumber(s[3] or '0')
    version = version + 1
    local fields = {'count', count + n, 'meta', ARGV[6], 'version', string.format('%d', version)}
    if gen == '' then  -- the hash is created: it joins its scope's index (once)
      gen = ARGV[14]
      fields[#fields + 1] = 'gen'
      fields[#fields + 1] = gen
      redis.call('ZADD', KEYS[7], now_ms(), ARGV[7])
    end
    for i = 1, n do  -- the rows and the head in one HSET (in chunks: unpack's stack)
      fields[#fields + 1] = 'm:' .. (count + i - 1)
      fields[#fields + 1] = ARGV[16 + i]
      if #fields >= 1000 then
        redis.call('HSET', KEYS[2], unpack(fields))
        fields = {}
      end
    end
    if #fields > 0 then redis.call('HSET', KEYS[2], unpack(fields)) end
    redis.call('ZADD', KEYS[6], now_ms(), ARGV[7])
  end
  -- its one entry was all S held, and S (= K) is the one stream selected below, which
  -- deletes it then anyway: deleted now, with its control hint (KEYS[17]), instead of
  -- XDEL + HDEL, and not again on release (a stream the lease keeps is never deleted
  -- here: its last id must stay, so an explicit id never goes back)
  sole = string.sub(ARGV[13], 1, 1) == '1' and #KEYS == 21 and KEYS[15] == KEYS[3]
    and ARGV[17 + n] == ARGV[7]
  if emptied and sole then
    redis.call('DEL', KEYS[3], KEYS[4], KEYS[17])
  else
    for id in string.gmatch(ARGV[2], '%S+') do
      redis.call('XDEL', KEYS[3], id)
      redis.call('HDEL', KEYS[4], id, id .. ':error')
    end
    if string.sub(ARGV[13], 3, 3) == 'p' and not emptied then shed_deleted(KEYS[3], 64) end
  end
  if ARGV[3] ~= '' then
    if safe(false, 'XADD', KEYS[5], 'MAXLEN', '~', ARGV[4], '*', 'payload', ARGV[3]) == false then
      redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[4], '*', 'payload', ARGV[3])  -- junk gone
    end
    redis.call('PEXPIRE', KEYS[5], ARGV[5])
    local pulsed = redis.pcall('XADD', KEYS[14], 'MAXLEN', '~', 10000, '*', 'o', KEYS[5])  -- PULSE_MAXLEN
    if type(pulsed) == 'table' and pulsed.err and string.find(tostring(pulsed.err), 'WRONGTYPE', 1, true) then
      redis.call('DEL', KEYS[14])  -- junk where the pulse belongs: replaced
      redis.call('XADD', KEYS[14], 'MAXLEN', '~', 10000, '*', 'o', KEYS[5])
    end
  end
  if ARGV[12] ~= '' then  -- junk where the dead letters belong (an operator's): replaced,
    -- not left to fail the script after the rows and the entry were written
    if safe(false, 'XADD', KEYS[11], 'MAXLEN', '~', ARGV[4], '*', 'entry', ARGV[12]) == false then
      redis.call('XADD', KEYS[11], 'MAXLEN', '~', ARGV[4], '*', 'entry', ARGV[12])
    end
  end
  if ARGV[8] == 'set' then
    local ttl = tonumber(ARGV[11])
    redis.call('HSET', KEYS[8], 'worker', ARGV[9])
    redis.call('PEXPIRE', KEYS[8], ttl)
    redis.call('ZADD', KEYS[9], now_ms() + ttl, ARGV[10])
  elseif ARGV[8] == 'del' then
    redis.call('DEL', KEYS[8])
    redis.call('ZREM', KEYS[9], ARGV[10])
  end
end
if string.sub(ARGV[13], 2, 2) == 'j' then redis.call('DEL', KEYS[13]) end

local out = {'ok', version, gen}
if string.sub(ARGV[13], 1, 1) ~= '1' then return out end
local streams = streams_of(15, 17 + n)
for _, st in ipairs(streams) do
  if emptied and st[1] == KEYS[3] then st.empty, st.deleted = true, sole end
end
local nxt = next_or_release(KEYS[1], KEYS[10], KEYS[12], streams, ARGV[7], ARGV[4])
for _, v in ipairs(nxt) do out[#out + 1] = v end
return out
