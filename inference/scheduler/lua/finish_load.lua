-- finish_load.lua: the single loader publishes the outcome (R4.2).
-- KEYS[1] base key of the model
-- ARGV[1] loader token   ARGV[2] 'ready' or 'failed'
-- ARGV[3] owner (Celery hostname) ARGV[4] owner boot id   ARGV[5] error text
-- ARGV[6] the pool's advertised capacity (slots it could run)
-- Returns 'ok', or 'stale' when another loader took over or the load was
-- abandoned (state no longer 'loading'): nothing changed then.
-- A ready outcome also sets last_used_ms = now (a fresh load is recent work).
-- Wakes every waiter registered by begin_load ('load:<token>').
local base = KEYS[1]
local key = base .. ':load'
if redis.call('HGET', key, 'loader') ~= ARGV[1] or redis.call('HGET', key, 'state') ~= 'loading' then
  return 'stale'
end
if ARGV[2] == 'ready' then
  redis.call('HSET', key, 'state', 'ready', 'owner', ARGV[3], 'boot', ARGV[4], 'error', '', 'capacity', ARGV[6],
              'last_used_ms', now_ms())
else
  redis.call('HSET', key, 'state', 'unloaded', 'error', ARGV[5])
  redis.call('HDEL', key, 'owner', 'boot')
end
redis.call('HDEL', key, 'loader', 'loader_expires_ms', 'loader_host')
local waiters = redis.call('HGETALL', base .. ':loadwait')
for i = 1, #waiters, 2 do
  redis.call('PUBLISH', waiters[i + 1], 'load:' .. waiters[i])
end
redis.call('DEL', base .. ':loadwait')
return 'ok'
