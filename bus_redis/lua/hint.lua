-- hint: delete a control hint with no inbound stream beside it (the janitor), atomically,
-- so a hint a frontend sets between the check and the delete is never lost.
-- KEYS[1] control hint S  KEYS[2] inbound stream S
-- returns 1 deleted, 0 kept (the stream exists)
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
return redis.call('DEL', KEYS[1])
