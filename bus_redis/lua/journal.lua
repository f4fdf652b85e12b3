-- journal: the tool journal of the turn running under lease K (rows of its tool
-- exchanges, recorded as they happen, so that a re-run after a crash replays them).
-- One turn runs under K at a time: the hash holds the rows of one entry, `entry`; rows of
-- another entry found there (a lost attempt of an entry since dead-lettered) are dropped.
-- KEYS[1] lease of K  KEYS[2] journal hash of K
-- ARGV[1] token  ARGV[2] the entry ("<session>|<entry id>")  ARGV[3] TTL (ms)
-- ARGV[4..] rows (JSON) to append; none: drop the entry's journal (its turn committed)
-- returns the number of rows held, 0 dropped, -1 lease lost
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
local held = redis.call('HGET', KEYS[2], 'entry')
if #ARGV == 3 then
  if held == ARGV[2] then redis.call('DEL', KEYS[2]) end
  return 0
end
if held ~= ARGV[2] then
  redis.call('DEL', KEYS[2])
  redis.call('HSET', KEYS[2], 'entry', ARGV[2])
end
local n = redis.call('HINCRBY', KEYS[2], 'n', #ARGV - 3)
for i = 4, #ARGV do
  redis.call('HSET', KEYS[2], tostring(n - #ARGV + i), ARGV[i])
end
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return n
