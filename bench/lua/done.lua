-- done (the baseline loop of bench/baseline.py): fenced commit of one turn: append the two
-- rows, write the reply event (and its pulse, as the wire asks), delete the entry,
-- acknowledge the notification, release.
-- KEYS[1] lease  KEYS[2] inbound stream  KEYS[3] history  KEYS[4] event stream  KEYS[5] ready
-- KEYS[6] the channel's pulse
-- ARGV[1] token  ARGV[2] entry id  ARGV[3] user row  ARGV[4] assistant row  ARGV[5] event
-- ARGV[6] notification id  ARGV[7] event stream MAXLEN
-- returns 1, or 0 when the lease is no longer ours (nothing written)
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('RPUSH', KEYS[3], ARGV[3], ARGV[4])
redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[7], '*', 'payload', ARGV[5])
redis.call('XADD', KEYS[6], 'MAXLEN', '~', 10000, '*', 'o', KEYS[4])
redis.call('XDEL', KEYS[2], ARGV[2])
redis.call('XACK', KEYS[5], 'workers', ARGV[6])
redis.call('DEL', KEYS[1])
return 1
