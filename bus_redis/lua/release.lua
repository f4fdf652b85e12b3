-- release: give a lease up now (shutdown, lost turn, an admin's hold), whatever is still
-- queued. The pending set stays, and the key is re-notified so that another worker
-- continues at once instead of waiting for the lease to expire: K itself (effective) when
-- streams are pending under it, else, for a key that is its own stream (KEYS[5]), S when
-- it holds entries (a notification that met the held lease was answered busy).
-- KEYS[1] lease  KEYS[2] pending  KEYS[3] ready stream of K's channel
-- KEYS[4] lease registry of K's channel  KEYS[5] (optional) inbound stream of K = S
-- ARGV[1] token  ARGV[2] K  ARGV[3] ready MAXLEN
-- returns 1 released, 0 not ours
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[4], ARGV[2])
-- (a ready queue that takes no entry (junk): the sweeps find the key again)
if redis.call('SCARD', KEYS[2]) > 0 then
  redis.pcall('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*', 'session', ARGV[2], 'effective', '1')
elseif KEYS[5] and redis.call('EXISTS', KEYS[5]) == 1 then
  redis.pcall('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*', 'session', ARGV[2])
end
return 1
