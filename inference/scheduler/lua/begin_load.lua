-- begin_load.lua: single-flight lazy loading (R4.2), across all processes.
-- KEYS[1] base key of the model      KEYS[2] worker liveness key prefix
-- ARGV[1] caller token   ARGV[2] caller's reply channel   ARGV[3] loader TTL in ms
-- ARGV[4] '1' to load even during a failed load's backoff (an explicit management load, R6.7)
-- ARGV[5] the caller's token of its previous 'wait' that was not woken ('' = none): it is
--         unregistered first, so a waiter that decides again every few seconds leaves
--         one ':loadwait' entry, not one per look. When that entry is already gone, the
--         load it waited for ended (or finished) since, and its wake-up is still on the way
--         (or was just missed): nothing is decided, the call answers {'woken'}
-- Returns one of:
--   {'ready', owner, boot}  loaded on a live worker (owner = Celery hostname)
--   {'wait', left_ms}       another caller is loading; 'load:<token>' is
--                           published on the channel when it finishes; left_ms:
--                           how long that load stays alive if its worker stops
--                           now (lib's loader_left_ms; -1 while no worker has
--                           started it): the caller decides again by then
--   {'load'}                the caller is now the single loader and must call
--                           finish_load (renewing with renew_load meanwhile); its
--                           channel is kept ('loader_channel'), so whoever else ends
--                           the load wakes it ('load:<token>', lib's wake_load_waiters)
--   {'backoff', retry_in_ms, error}  the last load failed and its backoff has
--                           not passed (R6.7): nothing changed
--   {'woken', outcome}      ARGV[5]'s wait was woken before this call (see ARGV[5]):
--                           outcome is how that load ended, kept for ARGV[5] in
--                           ':loadend:<ARGV[5]>' ('ready' or '<ended>:<error>'; ''
--                           once expired), as its wake-up carries it; the caller reports
--                           that end instead of becoming the next loader
--   {'lost', error, host}   the worker running the load in progress (host) is dead
--                           (lib's loader_dead: claim expired, or its liveness
--                           key gone, R7.4): this call ended that load
--                           ('ended' = 'worker_lost', state 'unloaded') and woke
--                           its waiters; nothing else changed. A caller that was
--                           waiting for that load reports it lost; a new caller
--                           calls again (and becomes the loader).
-- A 'ready' model whose owner's liveness key is gone or carries another boot
-- id becomes 'unloaded' here (R7.4). A claim that no worker started and that
-- its caller stopped renewing (expired) is taken over. Clock: redis TIME.
local base, live_prefix = KEYS[1], KEYS[2]
local token, chan, ttl_ms = ARGV[1], ARGV[2], tonumber(ARGV[3])
local now = now_ms()
local key = base .. ':load'
if ARGV[5] ~= '' and redis.call('HDEL', base .. ':loadwait', ARGV[5]) == 0 then
  return {'woken', redis.call('GET', base .. ':loadend:' .. ARGV[5]) or ''}
end
local state = redis.call('HGET', key, 'state') or 'unloaded'
if state == 'ready' then
  local owner = redis.call('HGET', key, 'owner')
  local boot = redis.call('HGET', key, 'boot')
  if owner and redis.call('GET', live_prefix .. owner) == boot then
    return {'ready', owner, boot}
  end
  redis.call('HSET', key, 'state', 'unloaded', 'error', 'worker lost')
  redis.call('HDEL', key, 'owner', 'boot')
  changed(base)
  state = 'unloaded'
end
if state == 'loading' then
  if loader_dead(key, live_prefix, now) then
    local host = redis.call('HGET', key, 'loader_host')
    local err = 'worker ' .. host .. ' was lost while loading the model'
    end_load(base, 'worker_lost', err, now)
    return {'lost', err, host}
  end
  local until_ms = tonumber(redis.call('HGET', key, 'loader_expires_ms') or '0')
  if until_ms > now then
    redis.call('HSET', base .. ':loadwait', token, chan)
    return {'wait', loader_left_ms(key, live_prefix, now) or -1}
  end
elseif ARGV[4] ~= '1' then
  local retry_at = tonumber(redis.call('HGET', key, 'retry_at_ms') or '0')
  if retry_at > now then
    return {'backoff', retry_at - now, redis.call('HGET', key, 'error') or ''}
  end
end
redis.call('HSET', key, 'state', 'loading', 'loader', token, 'loader_channel', chan, 'loader_expires_ms', now + ttl_ms)
redis.call('HDEL', key, 'loader_host', 'loader_boot', 'ended')
changed(base)
return {'load'}
