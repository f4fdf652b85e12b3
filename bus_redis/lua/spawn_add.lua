-- spawn_add: register a subagent of a durable session, fenced by the lease its turn runs
-- under (the job runs only while it is registered; see spawn_done.lua).
-- KEYS[1] lease of the turn  KEYS[2] the session's subagents (hash id -> JSON)
-- KEYS[3] the channel's index of sessions with subagents  KEYS[4] their scopes (hash)
-- ARGV[1] token  ARGV[2] subagent id  ARGV[3] what it does (JSON)  ARGV[4] at most this
-- many per session  ARGV[5] registration TTL (ms)  ARGV[6] session key  ARGV[7] at most
-- this many sessions of the channel with subagents  ARGV[8] the session's scope
-- ARGV[9] at most this many sessions of one scope with subagents
-- returns 1 added, 2 added already (the same call, run again), 0 too many running in the
-- session, -2 in the channel, -3 in the scope, -1 lease lost
-- Work: the channel's index holds at most ARGV[7] sessions (a further one is refused), so
-- counting the scope's share reads that many scopes at most.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
if redis.call('HEXISTS', KEYS[2], ARGV[2]) == 1 then return 2 end
if redis.call('HLEN', KEYS[2]) >= tonumber(ARGV[4]) then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local CHUNK = 1000  -- members passed to one command (Lua unpacks a few thousand at most)
local expired = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now - tonumber(ARGV[5]))
for i = 1, #expired, CHUNK do
  local part = {unpack(expired, i, math.min(i + CHUNK - 1, #expired))}
  redis.call('ZREM', KEYS[3], unpack(part))
  redis.call('HDEL', KEYS[4], unpack(part))
end
if not redis.call('ZSCORE', KEYS[3], ARGV[6]) then
  if redis.call('ZCARD', KEYS[3]) >= tonumber(ARGV[7]) then return -2 end
  local mine = 0
  for i = 0, tonumber(ARGV[7]) - 1, CHUNK do
    local members = redis.call('ZRANGE', KEYS[3], i, i + CHUNK - 1)
    if #members == 0 then break end
    for _, scope in ipairs(redis.call('HMGET', KEYS[4], unpack(members))) do
      if scope == ARGV[8] then mine = mine + 1 end
    end
  end
  if mine >= tonumber(ARGV[9]) then return -3 end
end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[5])
redis.call('ZADD', KEYS[3], now, ARGV[6])
redis.call('HSET', KEYS[4], ARGV[6], ARGV[8])
return 1
