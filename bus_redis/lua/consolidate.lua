-- consolidate: fenced end of a consolidation: append a summary to the scope's memory and
-- move the session's last_consolidated, in one step (memory is appended, never replaced,
-- so two consolidations of the same scope both keep their facts).
-- KEYS[1] lease of K  KEYS[2] session hash of K  KEYS[3] memory hash of the session's scope
-- ARGV[1] token  ARGV[2] session meta JSON (with the new last_consolidated)
-- ARGV[3] expected session version  ARGV[4] summary text
-- returns {'lost'} | {'moved'} (the session changed) | {'ok', session version, memory version}
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return {'lost'} end
if (redis.call('HGET', KEYS[2], 'version') or '0') ~= ARGV[3] then return {'moved'} end
redis.call('HSET', KEYS[2], 'meta', ARGV[2])
local version = redis.call('HINCRBY', KEYS[2], 'version', 1)
local old = redis.call('HGET', KEYS[3], 'content') or ''
local new = ARGV[4]
if old ~= '' then new = old .. '\n' .. ARGV[4] end
redis.call('HSET', KEYS[3], 'content', new)
local mv = redis.call('HINCRBY', KEYS[3], 'version', 1)
return {'ok', version, mv}
