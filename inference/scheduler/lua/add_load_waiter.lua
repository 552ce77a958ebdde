-- add_load_waiter.lua: wait for a load in progress without racing its end (R4.5).
-- Used by a manager that must not skip a pool still being built.
-- KEYS[1] base key of the model
-- ARGV[1] waiter token   ARGV[2] the waiter's reply channel
-- If a live loader holds the model (state 'loading', claim not expired in
-- Redis time), registers the waiter in ':loadwait' so finish_load publishes
-- 'load:<token>' on its channel, and returns {'wait', loader_expires_ms, now_ms}.
-- Otherwise registers nothing and returns {'idle', 0, now_ms}: no load runs,
-- or its loader died (its claim expired).
local base = KEYS[1]
local key = base .. ':load'
local now = now_ms()
if redis.call('HGET', key, 'state') ~= 'loading' or not redis.call('HGET', key, 'loader') then
  return {'idle', 0, now}
end
local until_ms = tonumber(redis.call('HGET', key, 'loader_expires_ms') or '0')
if until_ms <= now then return {'idle', 0, now} end
redis.call('HSET', base .. ':loadwait', ARGV[1], ARGV[2])
return {'wait', until_ms, now}
