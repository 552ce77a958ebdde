-- finish_load.lua: the single loader publishes the outcome (R4.2).
-- KEYS[1] base key of the model
-- ARGV[1] loader token   ARGV[2] 'ready' or 'failed'
-- ARGV[3] owner (Celery hostname) ARGV[4] owner boot id   ARGV[5] error text
-- ARGV[6] the pool's advertised capacity (slots it could run)
-- Returns 'ok', or 'stale' when another loader took over or the load was
-- abandoned (state no longer 'loading'): nothing changed then.
-- A ready outcome also sets last_used_ms = now (a fresh load is recent work)
-- and forgets earlier failures. A failure reported by a worker (owner given)
-- is remembered (R6.7): 'failures' counts consecutive ones, and no caller
-- loads again before 'retry_at_ms' = now + min(60 s, 1 s * 2^(failures-1))
-- (begin_load.lua refuses until then; an explicit management load may force).
-- A load nobody started or whose worker died (no owner) sets no backoff.
-- Wakes every waiter registered by begin_load ('load:<token>').
local base = KEYS[1]
local key = base .. ':load'
if redis.call('HGET', key, 'loader') ~= ARGV[1] or redis.call('HGET', key, 'state') ~= 'loading' then
  return 'stale'
end
if ARGV[2] == 'ready' then
  redis.call('HSET', key, 'state', 'ready', 'owner', ARGV[3], 'boot', ARGV[4], 'error', '', 'capacity', ARGV[6],
              'last_used_ms', now_ms())
  redis.call('HDEL', key, 'failures', 'retry_at_ms')
else
  redis.call('HSET', key, 'state', 'unloaded', 'error', ARGV[5])
  redis.call('HDEL', key, 'owner', 'boot')
  if ARGV[3] ~= '' then
    local failures = redis.call('HINCRBY', key, 'failures', 1)
    local delay_ms = math.min(BACKOFF_MAX_MS, BACKOFF_FIRST_MS * 2 ^ (failures - 1))
    redis.call('HSET', key, 'retry_at_ms', now_ms() + delay_ms)
  end
end
redis.call('HDEL', key, 'loader', 'loader_expires_ms', 'loader_host')
local waiters = redis.call('HGETALL', base .. ':loadwait')
for i = 1, #waiters, 2 do
  redis.call('PUBLISH', waiters[i + 1], 'load:' .. waiters[i])
end
redis.call('DEL', base .. ':loadwait')
return 'ok'
