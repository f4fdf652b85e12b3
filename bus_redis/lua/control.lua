-- control: record a control for workers that miss the pub/sub message, then publish it.
-- KEYS[1] control flag P:{S}:ctl   KEYS[2] inbound stream P:{S}:in
-- ARGV[1] control channel  ARGV[2] op ('discard' | 'stop')  ARGV[3] control JSON  ARGV[4] flag ttl ms
-- The flag holds "<op> <newest queued entry id> <server time ms>": entries up to that id
-- (published before the control) are cancelled without a turn.
-- returns the number of subscribers that received the message
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local newest = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)[1]
local boundary = newest and newest[1] or '0-0'
redis.call('SET', KEYS[1], ARGV[2] .. ' ' .. boundary .. ' ' .. now, 'PX', tonumber(ARGV[4]))
return redis.call('PUBLISH', ARGV[1], ARGV[3])
