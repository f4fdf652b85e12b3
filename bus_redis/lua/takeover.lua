-- takeover: the holder of a lease is dead (its liveness beat stopped): the lease is deleted
-- and its key re-notified at once, as the lease sweep does when a lease runs out, without
-- waiting for the TTL. Compare-and-delete: a lease renewed under another nonce, released or
-- taken meanwhile is left alone, and so is every lease of a worker that beats again (it
-- restarted under its id, or Redis stalled): silence is judged here, atomically, against
-- the freshest beat. The dead holder's late writes are fenced (its nonce is gone).
-- KEYS[1] lease P:{C}:lease:K  KEYS[2] lease registry P:{C}:leases  KEYS[3] ready P:{C}:ready
-- KEYS[4] P:alive (read only; a global key: standalone Redis, see ARCHITECTURE.md)
-- ARGV[1] the lease value seen ('<nonce>|<dead worker>')  ARGV[2] K  ARGV[3] ready MAXLEN
-- ARGV[4] dead worker id  ARGV[5] dead after (ms), or '' when the caller is that worker
-- itself, starting (every lease under its id is a former life's)
-- ARGV[6] '1' in the unified channel: the notification is marked effective (K drains a
-- pending set); elsewhere K is its own stream, notified plainly (as sweep.lua does)
-- returns 1 (taken over), 0 (the lease changed, or its holder beats), or
-- {'!unusable', error} (ready queue)
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[5] ~= '' then
  local beat = redis.call('ZSCORE', KEYS[4], ARGV[4])
  local fresh = redis.call('ZREVRANGE', KEYS[4], 0, 0, 'WITHSCORES')
  if beat and fresh[2] and tonumber(beat) >= tonumber(fresh[2]) - tonumber(ARGV[5]) then
    return 0
  end
end
local r
if ARGV[6] == '1' then
  r = redis.pcall('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*', 'session', ARGV[2], 'effective', '1')
else
  r = redis.pcall('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*', 'session', ARGV[2])
end
if type(r) == 'table' and r.err then return {'!unusable', r.err} end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[2])
return 1
