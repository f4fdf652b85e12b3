-- claim: a worker process takes its worker id at start, atomically. Two processes started
-- at once with one id both find no live record when they look; only the first to claim
-- it gets it, and the second is told whose it is (and refuses to start).
-- KEYS[1] the id's info hash (P:worker:<id>:info)  KEYS[2] P:workers (id -> heartbeat ms)
-- ARGV[1] worker id  ARGV[2] the claim the caller read in KEYS[1] ('' none)
-- ARGV[3] this process's claim (unique)  ARGV[4] host  ARGV[5] pid
-- ARGV[6] ms the info hash is kept without a heartbeat  ARGV[7] heartbeat time (ms)
-- returns 1 when claimed, else {host, pid} of the process that claimed the id first
local claim = redis.call('HGET', KEYS[1], 'claim') or ''
if claim ~= '' and claim ~= ARGV[2] then  -- (a record that expired meanwhile may be taken)
  return redis.call('HMGET', KEYS[1], 'host', 'pid')
end
redis.call('HSET', KEYS[1], 'claim', ARGV[3], 'host', ARGV[4], 'pid', ARGV[5])
redis.call('PEXPIRE', KEYS[1], ARGV[6])
redis.call('ZADD', KEYS[2], ARGV[7], ARGV[1])
return 1
