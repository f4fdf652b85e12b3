-- heartbeat: a worker's record (every maintenance tick), only while the id is still this
-- process's. A worker stopped (SIGSTOP, a VM paused) past its record's life may find that
-- another process claimed the id meanwhile (claim.lua: the record looked dead); woken, it
-- must not write over that claim and serve beside it under one id (private sessions'
-- records would name both), so it is told whose the id is now and stops.
-- KEYS[1] the id's info hash (P:worker:<id>:info)  KEYS[2] P:workers  KEYS[3] P:mode
-- ARGV[1] worker id  ARGV[2] this process's claim ('' none: not checked)
-- ARGV[3] ms the info hash is kept  ARGV[4] the deployment's mode ('' none)
-- ARGV[5..] the record's field, value pairs
-- returns 1, or {host, pid} of the process whose claim the record holds now
local mine = ARGV[2]
local claim = redis.call('HGET', KEYS[1], 'claim')
if mine ~= '' and claim and claim ~= mine then
  return redis.call('HMGET', KEYS[1], 'host', 'pid')
end
local t = redis.call('TIME')  -- Redis' clock: hosts whose clocks differ are judged alike
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if ARGV[4] ~= '' then
  redis.call('SET', KEYS[3], ARGV[4], 'NX')
end
redis.call('ZADD', KEYS[2], now, ARGV[1])
local fields = {}
for i = 5, #ARGV do
  fields[#fields + 1] = ARGV[i]
end
if mine ~= '' then
  fields[#fields + 1] = 'claim'
  fields[#fields + 1] = mine
end
if #fields > 0 then
  redis.call('HSET', KEYS[1], unpack(fields))
end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
