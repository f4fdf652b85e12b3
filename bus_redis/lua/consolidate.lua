-- consolidate: fenced end of a consolidation: replace the scope's memory by its updated
-- version, append a dated entry to the scope's history archive and move the session's
-- last_consolidated, in one step. Compare-and-set on the memory version: when another
-- consolidation of the scope wrote first, nothing is written and the caller folds again
-- from the memory that now is (so neither loses the other's facts).
-- KEYS[1] lease of K  KEYS[2] session hash of K  KEYS[3] memory hash of the session's scope
-- KEYS[4] history archive of the scope (stream)
-- ARGV[1] token  ARGV[2] session meta JSON (with the new last_consolidated)
-- ARGV[3] expected session version  ARGV[4] the updated memory text
-- ARGV[5] the memory version it was made from  ARGV[6] history entry ('' none)
-- ARGV[7] archive MAXLEN  ARGV[8] how long the archive keeps an entry, ms (0: for good)
-- The archive holds the text of old rows (a [RAW] entry is a verbatim transcript), so it
-- keeps nothing longer than an idle session is kept: each append drops the entries older
-- than ARGV[8] (at most MAXLEN of them) and sets the archive to expire ARGV[8] after it.
-- returns {'lost'} | {'moved'} (the session changed) | {'memory_moved'} (memory changed)
--       | {'ok', session version, memory version}
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return {'lost'} end
if (redis.call('HGET', KEYS[2], 'version') or '0') ~= ARGV[3] then return {'moved'} end
if (redis.call('HGET', KEYS[3], 'version') or '0') ~= ARGV[5] then return {'memory_moved'} end
-- The archive entry is written first: an append that fails (junk at the key, an archive
-- whose last id is the maximal one: replaced) must not leave the memory moved and the
-- session's last_consolidated past rows that no archive entry holds.
if ARGV[6] ~= '' then
  local added = redis.pcall('XADD', KEYS[4], 'MAXLEN', '~', ARGV[7], '*', 'entry', ARGV[6])
  if type(added) == 'table' and added.err then
    local err = tostring(added.err)
    -- an operator's junk or a spent id space is replaced; anything else (out of memory)
    -- fails the script before it wrote anything
    if not (string.find(err, 'WRONGTYPE', 1, true) or string.find(err, 'exhausted', 1, true)) then
      return redis.error_reply(err)
    end
    redis.call('DEL', KEYS[4])
    redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[7], '*', 'entry', ARGV[6])
  end
  local keep = tonumber(ARGV[8]) or 0
  if keep > 0 then  -- counted from the server's clock, not from an id an operator chose
    local t = redis.call('TIME')
    local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    redis.call('XTRIM', KEYS[4], 'MINID', string.format('%.0f', math.max(0, now - keep)))
    redis.call('PEXPIRE', KEYS[4], keep)
  end
end
redis.call('HSET', KEYS[2], 'meta', ARGV[2])
local version = redis.call('HINCRBY', KEYS[2], 'version', 1)
redis.call('HSET', KEYS[3], 'content', ARGV[4])
local mv = redis.call('HINCRBY', KEYS[3], 'version', 1)
return {'ok', version, mv}
