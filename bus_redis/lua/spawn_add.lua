-- spawn_add: register a subagent of a durable session, fenced by the lease its turn runs
-- under (the job runs only while it is registered; see spawn_done.lua).
-- KEYS[1] lease of the turn  KEYS[2] the session's subagents (hash id -> JSON)
-- KEYS[3] the channel's index of sessions with subagents
-- ARGV[1] token  ARGV[2] subagent id  ARGV[3] what it does (JSON)  ARGV[4] at most this
-- many per session  ARGV[5] registration TTL (ms)  ARGV[6] session key  ARGV[7] at most
-- this many sessions of the channel with subagents
-- returns 1 added, 2 added already (the same call, run again), 0 too many running in the
-- session, -2 in the channel, -1 lease lost
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
if redis.call('HEXISTS', KEYS[2], ARGV[2]) == 1 then return 2 end
if redis.call('HLEN', KEYS[2]) >= tonumber(ARGV[4]) then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now - tonumber(ARGV[5]))  -- expired ones
if not redis.call('ZSCORE', KEYS[3], ARGV[6])
    and redis.call('ZCARD', KEYS[3]) >= tonumber(ARGV[7]) then
  return -2
end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[5])
redis.call('ZADD', KEYS[3], now, ARGV[6])
return 1
