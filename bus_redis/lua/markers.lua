-- markers: the op of the first control marker queued after a running entry (a worker
-- confirming a stop / discard / delete it heard over pub/sub), read in bounded steps.
-- KEYS[1] inbound stream S  KEYS[2] attempts S  KEYS[3] control hint S
-- ARGV[1] id of the running entry  ARGV[2] where the last call stopped ('' first call)
-- returns {op} ('' when no marker is queued; interrupt markers are passed over: an
-- interrupt is carried out only after its scope check, interrupts.py) or {'again', resume
-- id}: MARKER_SCAN entries
-- (or SCAN_BYTES) were read without an answer: call again. When every entry of S comes
-- after or is the running entry (the usual case: it is the oldest), the memos in the
-- attempts hash are used and advanced, so each entry is read once however many controls
-- ask.
local s = {KEYS[1], KEYS[2], KEYS[3]}
local first = safe({}, 'XRANGE', s[1], '-', '+', 'COUNT', 1)[1]
if not first then return {''} end
if not id_less(ARGV[1], first[1]) and first[1] ~= ARGV[1] then
  -- the running entry is not the oldest (the in-process API's marker): no memos
  local hint = tonumber(safe(false, 'GET', s[3]) or '0') or 1
  if hint <= 0 then return {''} end
  local from = ARGV[2] ~= '' and ARGV[2] or ARGV[1]
  local read, bytes = 0, 0
  while read < MARKER_SCAN and bytes < SCAN_BYTES do
    local e = entry_after(s[1], from)
    if not e then return {''} end
    local op = field(e[2], 'control')
    if op and op ~= 'interrupt' then return {op} end  -- (an interrupt: its scope decides)
    read, bytes, from = read + 1, bytes + entry_bytes(e), e[1]
  end
  return {'again', from}
end
if first[1] ~= ARGV[1] then  -- the running entry is gone: every queued entry is after it
  local op = field(first[2], 'control')
  if op and op ~= 'interrupt' then return {op} end
end
local op = covering_op(s, first[1])
if op == nil then return {'again', ''} end
return {op}
