-- spawn_done: a subagent's registration while it runs, and its end: its result is
-- published into its session's stream as a frontend publishes a message, only while it
-- is still registered (a stop, discard or delete of the session unregisters it).
-- KEYS[1] the session's subagents  KEYS[2] the channel's index of sessions with subagents
-- KEYS[3] the session's inbound stream  KEYS[4] channel's queued index  KEYS[5] its ready queue
-- KEYS[6] the lease of the turn dropping it (an undo; else KEYS[1])
-- KEYS[7] the scopes of the channel's sessions with subagents (hash)
-- KEYS[8] the owner record of the session's own key (a private session open on KEYS[3])
-- ARGV[1] subagent id  ARGV[2] 'running' (ARGV[3]: what it does now, JSON), 'done'
-- (ARGV[3]: the result message, JSON) or 'drop'  ARGV[4] session key  ARGV[5] ready MAXLEN
-- ARGV[6] that turn's lease token ('': not fenced)  ARGV[7] the registrations' TTL (ms):
-- a start renews it (a job that starts late must not outlive its registration)
-- ARGV[8] 'done', 'drop': the run publishing or dropping it ('' or absent: any); a run
-- superseded (its worker stalled, judged dead, the subagent re-run by a survivor)
-- publishes and drops nothing
-- 'running' is refused (0) to the worker a survivor took the job from before it started
-- (the registration's taken_from: it was judged dead, and the job runs again), for a
-- start of its job begun before the take (ARGV[3]'s job_started_us, by the server's
-- clock in microseconds, at most the registration's taken_us; either absent: refused): the re-run may
-- be taken by that worker too
-- returns 1 done, 0 not registered (aborted, done already, or superseded), -1 the
-- dropping turn's lease is lost (a stalled worker's cut turn must not undo what the
-- holder after it kept), -3 'done' not now: a private session is open on the session's
-- key or its opening waits in the stream (_openings.lua), whose conversation the result
-- must not run in (it would be refused there and lost); nothing published, the
-- registration kept (its TTL renewed) for a later try
if ARGV[6] ~= '' and redis.call('GET', KEYS[6]) ~= ARGV[6] then return -1 end
local doc = redis.call('HGET', KEYS[1], ARGV[1])
if not doc then return 0 end
if ARGV[2] ~= 'running' and ARGV[8] and ARGV[8] ~= '' then
  local ok, spec = pcall(cjson.decode, doc)
  if not ok or type(spec) ~= 'table' or spec['run'] ~= ARGV[8] then return 0 end
end
if ARGV[2] == 'running' then
  local ok, spec = pcall(cjson.decode, doc)
  if ok and type(spec) == 'table' and type(spec['taken_from']) == 'string' then
    local ok2, now = pcall(cjson.decode, ARGV[3])
    if ok2 and type(now) == 'table' and now['worker'] == spec['taken_from'] then
      local began, took = tonumber(now['job_started_us']), tonumber(spec['taken_us'])
      if not began or not took or began <= took then return 0 end
    end
  end
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
  redis.call('PEXPIRE', KEYS[1], ARGV[7])
  return 1
end
if ARGV[2] == 'done' then
  if private_waits(KEYS[8], KEYS[3]) then
    redis.call('PEXPIRE', KEYS[1], ARGV[7])
    return -3
  end
  local added = redis.pcall('XADD', KEYS[3], '*', 'payload', ARGV[3])
  if type(added) == 'table' and added.err then
    local err = tostring(added.err)
    -- the stream itself takes no entry, ever (another type; the maximal id): move on
    if not (string.find(err, 'WRONGTYPE', 1, true) or string.find(err, 'equal or smaller', 1, true)
        or string.find(err, 'exhausted', 1, true)) then
      return redis.error_reply(err)  -- e.g. OOM: still registered, tried again
    end
  else  -- published: a refused notification must not make the result published twice
    -- (the stranded-stream sweep finds the stream instead)
    redis.pcall('ZADD', KEYS[4], 'NX', 0, ARGV[4])
    redis.pcall('XADD', KEYS[5], 'MAXLEN', '~', ARGV[5], '*', 'session', ARGV[4])
  end
end
redis.call('HDEL', KEYS[1], ARGV[1])
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('ZREM', KEYS[2], ARGV[4])
  redis.call('HDEL', KEYS[7], ARGV[4])
end
return 1
