-- Shared prelude of the scripts that publish a worker-made message into a chat's stream
-- (a schedule's firing, a subagent's result): whether a private session is open on the
-- chat's key, or its opening waits in the stream. Either way the message would follow
-- it into the private conversation, be refused there and be lost: it is put off instead.
-- Not a script of its own. `owner` is the owner record of the stream's own key (written
-- when the opening is handled), `stream` the chat's inbound stream.
-- The stream's entries are read one at a time, at most OPEN_SCAN of them or SCAN_BYTES;
-- a longer queue counts as a waiting opening (the message would wait behind that queue
-- anyway). A message that merely names the op is taken for an opening: that only puts
-- the message off until it was handled.
local function private_waits(owner, stream)
  if redis.call('EXISTS', owner) == 1 then return true end
  local OPEN_SCAN, SCAN_BYTES = 16, 1048576
  local read, bytes, from = 0, 0, '-'
  while true do
    local r = redis.pcall('XRANGE', stream, from, '+', 'COUNT', 1)
    if type(r) ~= 'table' or r.err or #r == 0 then return false end  -- (junk: XADD says)
    if read == OPEN_SCAN or bytes >= SCAN_BYTES then return true end
    local e = r[1]
    for i = 1, #e[2] - 1, 2 do
      local v = e[2][i + 1]
      bytes = bytes + #v
      if e[2][i] == 'payload' and string.find(v, 'open_transient', 1, true) then
        return true
      end
    end
    read, from = read + 1, '(' .. e[1]
  end
end
