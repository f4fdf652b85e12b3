-- acquire: take the lease of an effective session key K and select its first entry.
-- KEYS[1] lease    P:{C}:lease:K     "<nonce>|<worker>" with PX ttl
-- KEYS[2] pending  P:{C}:pending:K   inbound streams the holder must drain (PX, renewed)
-- KEYS[3] session  P:{C}:session:K   durable session hash (for its version and generation)
-- KEYS[4] memory   memory hash of the cached session's scope (for its version), or KEYS[3]
-- KEYS[5] owner    P:{C}:owner:S     transient owner record of the notified stream S
-- KEYS[6] notes    the stream the notification came from (ready queue or inbox)
-- KEYS[7] leases   P:{C}:leases      lease registry of K's channel (K -> expiry ms)
-- KEYS[8] lease S  P:{C}:lease:S     the notified stream's own lease (= KEYS[1] when K = S)
-- KEYS[9] lease U  the lease of the key streams fold under (unified mode), = KEYS[1] when
--                  none (no stream is folded: nothing to look at)
-- KEYS[10] pending U  that key's pending set
-- KEYS[11..17]     stream keys of S (see _common.lua), only when selecting
-- ARGV[1] worker id   ARGV[2] lease ttl ms   ARGV[3] K   ARGV[4] S ('' when none)
-- ARGV[5] '1' when this worker is opening K's transient session (claims ownership), '2'
--         when it holds one opened before (whose record must still be there), else '0'
-- ARGV[6] owner ttl ms   ARGV[7] '1' to select the first entry (or release at once)
-- ARGV[8] lease nonce    ARGV[9] ready MAXLEN    ARGV[10] notification entry id ('' none)
-- ARGV[11] consumer group
-- ARGV[12] rows of the session hash the worker's cached copy has seen   ARGV[13] how many
--          rows past them to read when it is behind ('0': no cached copy)
-- ARGV[14] the cached copy's generation   ARGV[15] its version
-- ARGV[16] S again (member of the stream keys)
-- returns {'gone'}                     ARGV[5] '2' and S has no owner record: the
--                                      session was lost (its record ran out; the loss
--                                      is told by the owners' sweep): forget it, retry
--       | {'private'}                  K ~= S but S is an open private session: retry
--                                      with K = S
--       | {'fold'}                     K = S is folded under U (KEYS[9]) and S is no
--                                      private session (no owner, none claimed): retry
--                                      with K = U
--       | {'forward', owner}           K belongs to another worker's private session
--       | {'busy', holder}
--       | {'acquired', token, version, generation, memory version, ahead, <next_or_release...>}
-- ahead: {} when the cached copy is current or not of this generation, or when no entry
-- was selected (no turn runs yet), else what it lacks (one round trip less when
-- consecutive turns run on different workers):
-- {meta, count, row ARGV[12], row ARGV[12] + 1, ...}: at most ARGV[13] rows, and none past
-- the hash's count (a lookup of a field that is not there costs as much as one that is)
-- A stream S folded under another key K joins K's pending set before any forward or busy
-- answer, so that whoever holds or acquires K next drains it (a forward lost with its owner
-- included). A key that is its own stream (K = S) keeps no pending set on its turns: its
-- holder reads S itself, and a release without a commit re-notifies K while S holds
-- entries (release.lua). Only a busy answer names S in K's pending set there (not a turn's
-- cost: a note that met a held lease), so that a release that does not name S (a worker
-- or admin tool from before 1aee1e9, in a rolling upgrade) still re-notifies K. The
-- notification is acknowledged (and deleted) last, so a script that fails midway (e.g.
-- OOM) leaves it pending for redelivery.
local function ack()
  if ARGV[10] ~= '' then
    redis.call('XACK', KEYS[6], ARGV[11], ARGV[10])
    redis.call('XDEL', KEYS[6], ARGV[10])
  end
end

local owner = redis.call('HGET', KEYS[5], 'worker')
if ARGV[5] == '2' and not owner then return {'gone'} end  -- never re-created by a stalled worker
if ARGV[4] ~= '' and ARGV[3] ~= ARGV[4] then  -- S folded under K
  if owner then return {'private'} end
  -- S has a holder of its own (an admin's hold, a former private session's turn): busy,
  -- answered here, and that holder drains S or re-notifies it on release (retried as
  -- K = S instead, S could be folded under K in between and its entry selected twice)
  local own = redis.call('GET', KEYS[8])
  if own then
    ack()
    return {'busy', own}
  end
  redis.call('SADD', KEYS[2], ARGV[4])
elseif ARGV[4] == ARGV[3] and KEYS[9] ~= KEYS[1] and not owner and ARGV[5] ~= '1' then
  -- K = S, S is folded under the unified key U, and S is no private session (a retry
  -- after 'private' whose session ended meanwhile): its durable turns are U's, never
  -- stored under S's own lease
  return {'fold'}
elseif ARGV[4] == ARGV[3] and KEYS[9] ~= KEYS[1]
    and redis.call('SISMEMBER', KEYS[10], ARGV[4]) == 1 then
  -- K = S, and S is folded under the unified key U: while U is held, U's holder drains S
  -- (or leaves it, re-notified, once S is private): busy, never S's entry selected under
  -- S's own lease too (a retry after 'private' when the private session ended meanwhile;
  -- an owner whose record ran out while S was folded)
  local unified = redis.call('GET', KEYS[9])
  if unified then
    ack()
    return {'busy', unified}
  end
end
if owner and owner ~= ARGV[1] then
  ack()
  return {'forward', owner}
end
local token = ARGV[8] .. '|' .. ARGV[1]
local ttl = tonumber(ARGV[2])
if not redis.call('SET', KEYS[1], token, 'NX', 'PX', ttl) then
  local holder = redis.call('GET', KEYS[1])
  if ARGV[4] == ARGV[3] then  -- K = S (a folded S joined above)
    redis.call('SADD', KEYS[2], ARGV[4])
    redis.call('PEXPIRE', KEYS[2], 2 * ttl)
  end
  ack()
  return {'busy', holder}
end
if ARGV[5] == '1' and redis.call('EXISTS', KEYS[5]) == 0 then
  redis.call('HSET', KEYS[5], 'worker', ARGV[1])
  redis.call('PEXPIRE', KEYS[5], ARGV[6])
end
if ARGV[4] ~= ARGV[3] then redis.call('PEXPIRE', KEYS[2], 2 * ttl) end  -- (K = S: none)
redis.call('ZADD', KEYS[7], now_ms() + ttl, ARGV[3])
local s = redis.call('HMGET', KEYS[3], 'version', 'gen', 'count')
local memory = redis.call('HGET', KEYS[4], 'version') or '0'
local nxt = {}
if ARGV[7] == '1' then
  nxt = next_or_release(KEYS[1], KEYS[2], KEYS[7], streams_of(11, 16), ARGV[3], ARGV[9])
end
local ahead = {}
local want = tonumber(ARGV[13])
if nxt[1] == 'entry' and want > 0 and s[2] == ARGV[14] and (s[1] or '0') ~= ARGV[15] then
  local fields = {'meta', 'count'}
  local have = tonumber(ARGV[12])
  local last = math.min(have + want, tonumber(s[3] or '0') or 0) - 1
  for i = have, last do fields[#fields + 1] = 'm:' .. i end
  ahead = redis.call('HMGET', KEYS[3], unpack(fields))
end
local head = {'acquired', token, s[1] or '0', s[2] or '', memory, ahead}
for _, v in ipairs(nxt) do head[#head + 1] = v end
ack()
return head
