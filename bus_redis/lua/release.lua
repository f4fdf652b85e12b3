-- release: give a lease up now (shutdown, lost turn, an admin's hold), whatever is still
-- queued. The pending set stays (but for K = S's note of itself), and the
-- key is re-notified so that another worker continues at once instead of waiting for the
-- lease to expire: for a key that is its own stream (KEYS[5]), a plain notification of S
-- when it holds entries (one that met the held lease was answered busy), which a worker
-- of any version serves by reading S; else K itself (effective) when streams are pending
-- under it.
-- KEYS[1] lease  KEYS[2] pending  KEYS[3] ready stream of K's channel
-- KEYS[4] lease registry of K's channel  KEYS[5] (optional) inbound stream of K = S
-- KEYS[6] (with KEYS[5]) attempts hash of S  KEYS[7] its control hint
-- ARGV[1] token  ARGV[2] K  ARGV[3] ready MAXLEN
-- ARGV[4] (optional, with KEYS[5..7]) the id of a new or delete marker at the head of S
--         the holder acted on: consumed first (as next.lua does)
-- returns 1 released, 0 not ours
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if KEYS[7] and ARGV[4] and ARGV[4] ~= '' then
  consume_marker({KEYS[5], KEYS[6], KEYS[7]}, ARGV[4])
end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[4], ARGV[2])
-- (a ready queue that takes no entry (junk): the sweeps find the key again)
if KEYS[5] then
  -- a busy answer's note of S in K's own pending set is done with: S is notified here
  -- when it holds entries (the note is for releases that do not name S: acquire.lua)
  redis.call('SREM', KEYS[2], ARGV[2])
  local queued = redis.pcall('XLEN', KEYS[5])  -- (junk in S's place: notified, as before)
  if type(queued) ~= 'number' or queued > 0 then
    redis.pcall('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*', 'session', ARGV[2])
  end
elseif redis.call('SCARD', KEYS[2]) > 0 then
  redis.pcall('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*', 'session', ARGV[2], 'effective', '1')
end
return 1
