-- markers: the op of the first control marker queued after a running entry (a worker
-- confirming a stop / discard / delete it heard over pub/sub), read in bounded steps.
-- KEYS[1] inbound stream S  KEYS[2] attempts S  KEYS[3] control hint S
-- ARGV[1] id of the running entry  ARGV[2] where the last call stopped ('' first call)
-- returns {op} ('' when no marker is queued) or {'again', resume id}: MARKER_SCAN entries
-- were read without an answer. When the running entry is the oldest of S (the usual
-- case) the memos in the attempts hash are used and advanced, so each entry is read once
-- however many controls ask.
local s = {KEYS[1], KEYS[2], KEYS[3]}
local first = safe({}, 'XRANGE', s[1], '-', '+', 'COUNT', 1)[1]
if not first then return {''} end
if first[1] == ARGV[1] then
  local op = covering_op(s, ARGV[1])
  if op == nil then return {'again', ''} end
  return {op}
end
local hint = tonumber(safe(false, 'GET', s[3]) or '0') or 1
if hint <= 0 then return {''} end
local from = ARGV[2] ~= '' and ARGV[2] or ARGV[1]
local rest = redis.call('XRANGE', s[1], '(' .. from, '+', 'COUNT', MARKER_SCAN)
for _, e in ipairs(rest) do
  local op = field(e[2], 'control')
  if op then return {op} end
end
if #rest == MARKER_SCAN then return {'again', rest[#rest][1]} end
return {''}
