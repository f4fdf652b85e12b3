-- Shared prelude of the scripts that remove a schedule: its scope's count goes with it.
-- Not a script of its own. `scope_of` is the channel's hash schedule id -> scope,
-- `per_scope` its hash scope -> how many schedules that scope holds (cron_add.lua).
local function forget_cron_scope(scope_of, per_scope, sid)
  local scope = redis.call('HGET', scope_of, sid)
  if scope then
    redis.call('HDEL', scope_of, sid)
    if redis.call('HINCRBY', per_scope, scope, -1) <= 0 then redis.call('HDEL', per_scope, scope) end
  end
end
