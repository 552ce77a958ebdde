-- begin_load.lua: single-flight lazy loading (R4.2), across all processes.
-- KEYS[1] base key of the model      KEYS[2] worker liveness key prefix
-- ARGV[1] caller token   ARGV[2] caller's reply channel   ARGV[3] loader TTL in ms
-- ARGV[4] '1' to load even during a failed load's backoff (an explicit management load, R6.7)
-- Returns one of:
--   {'ready', owner, boot}  loaded on a live worker (owner = Celery hostname)
--   {'wait'}                another caller is loading; 'load:<token>' is
--                           published on the channel when it finishes
--   {'load'}                the caller is now the single loader and must call
--                           finish_load (renewing with renew_load meanwhile)
--   {'backoff', retry_in_ms, error}  the last load failed and its backoff has
--                           not passed (R6.7): nothing changed
-- A 'ready' model whose owner's liveness key is gone or carries another boot
-- id becomes 'unloaded' here (R7.4). A loader that stopped renewing is
-- replaced. Clock: redis TIME.
local base, live_prefix = KEYS[1], KEYS[2]
local token, chan, ttl_ms = ARGV[1], ARGV[2], tonumber(ARGV[3])
local now = now_ms()
local key = base .. ':load'
local state = redis.call('HGET', key, 'state') or 'unloaded'
if state == 'ready' then
  local owner = redis.call('HGET', key, 'owner')
  local boot = redis.call('HGET', key, 'boot')
  if owner and redis.call('GET', live_prefix .. owner) == boot then
    return {'ready', owner, boot}
  end
  redis.call('HSET', key, 'state', 'unloaded', 'error', 'worker lost')
  redis.call('HDEL', key, 'owner', 'boot')
  state = 'unloaded'
end
if state == 'loading' then
  local until_ms = tonumber(redis.call('HGET', key, 'loader_expires_ms') or '0')
  if until_ms > now then
    redis.call('HSET', base .. ':loadwait', token, chan)
    return {'wait'}
  end
elseif ARGV[4] ~= '1' then
  local retry_at = tonumber(redis.call('HGET', key, 'retry_at_ms') or '0')
  if retry_at > now then
    return {'backoff', retry_at - now, redis.call('HGET', key, 'error') or ''}
  end
end
redis.call('HSET', key, 'state', 'loading', 'loader', token, 'loader_expires_ms', now + ttl_ms)
redis.call('HDEL', key, 'loader_host')
return {'load'}
