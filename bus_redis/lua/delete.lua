-- delete: remove a durable session under its lease (so no running turn re-creates it).
-- KEYS[1] lease of the holder  KEYS[2] session hash  KEYS[3] channel's sessions index
-- KEYS[4] scope index of the session ('' scope: KEYS[3] again)  KEYS[5] the session's events
-- ARGV[1] token  ARGV[2] the session key
-- returns 1 deleted, 0 nothing stored, -1 lease lost
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
redis.call('ZREM', KEYS[3], ARGV[2])
redis.call('ZREM', KEYS[4], ARGV[2])
redis.call('DEL', KEYS[5])
return redis.call('DEL', KEYS[2])
