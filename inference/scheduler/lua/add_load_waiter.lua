-- add_load_waiter.lua: wait for a load in progress without racing its end (R4.5).
-- Used by a manager that must not skip a pool still being built.
-- KEYS[1] base key of the model      KEYS[2] worker liveness key prefix
-- ARGV[1] waiter token   ARGV[2] the waiter's reply channel
-- ARGV[3] the waiter's token of its previous look ('' = none), unregistered first, so a waiter
--         that looks again every few seconds leaves one ':loadwait' entry, not one per look
-- If a live loader holds the model (state 'loading', claim not expired in
-- Redis time, and the worker running it, if one started it, still beats),
-- registers the waiter in ':loadwait' so the load's end publishes
-- 'load:<token>' on its channel, and returns {'wait', loader_expires_ms, now_ms}.
-- Otherwise registers nothing and returns {'idle', 0, now_ms}: no load runs,
-- or its loader died (R7.4; the manager's teardown then clears the claim).
local base = KEYS[1]
local key = base .. ':load'
if ARGV[3] ~= '' then redis.call('HDEL', base .. ':loadwait', ARGV[3]) end
local now = now_ms()
if redis.call('HGET', key, 'state') ~= 'loading' or not redis.call('HGET', key, 'loader') then
  return {'idle', 0, now}
end
local until_ms = tonumber(redis.call('HGET', key, 'loader_expires_ms') or '0')
if until_ms <= now or loader_dead(key, KEYS[2], now) then return {'idle', 0, now} end
redis.call('HSET', base .. ':loadwait', ARGV[1], ARGV[2])
return {'wait', until_ms, now}
