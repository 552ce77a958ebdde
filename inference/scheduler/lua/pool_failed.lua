-- pool_failed.lua: a loaded pool ended unasked (its model's process crashed, or was killed for a run
-- past its deadline, R3.6): recorded as a failed load is (R6.7).
-- KEYS[1] base key   ARGV[1] boot id of the worker that held the pool   ARGV[2] error text
-- Only a 'ready' state with that boot changes (a teardown's 'unloading' or another worker's pool is
-- left alone): state 'unloaded' with 'ended' = 'failed', the error, and the backoff of a failed load
-- (begin_load.lua refuses loads until retry_at_ms; an explicit management load may force).
-- Returns 1 if changed, else 0. Clock: redis TIME.
local key = KEYS[1] .. ':load'
if redis.call('HGET', key, 'state') ~= 'ready' or redis.call('HGET', key, 'boot') ~= ARGV[1] then return 0 end
local failures = redis.call('HINCRBY', key, 'failures', 1)
local delay_ms = math.min(BACKOFF_MAX_MS, BACKOFF_FIRST_MS * 2 ^ (failures - 1))
redis.call('HSET', key, 'state', 'unloaded', 'error', ARGV[2], 'ended', 'failed', 'retry_at_ms', now_ms() + delay_ms)
redis.call('HDEL', key, 'owner', 'boot')
changed(KEYS[1])
return 1
