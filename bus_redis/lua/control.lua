-- control: record a control for workers that miss the pub/sub message, then publish it.
-- KEYS[1] control flag P:{S}:ctl
-- ARGV[1] control channel  ARGV[2] op ('discard' | 'stop')  ARGV[3] control JSON  ARGV[4] flag ttl ms
-- The flag holds "<op> <server time ms>": entries published before that time are cancelled.
-- returns the number of subscribers that received the message
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('SET', KEYS[1], ARGV[2] .. ' ' .. now, 'PX', tonumber(ARGV[4]))
return redis.call('PUBLISH', ARGV[1], ARGV[3])
