-- snapshot.lua: one atomic read of every listed model (R4.7). Reserves nothing.
-- KEYS[1..n] base keys of the models     KEYS[n+1] worker liveness key prefix
-- KEYS[n+2] the published registrations (hash: model id -> JSON)
-- ARGV[1] half-life of the recent-use count in ms    ARGV[2..n+1] the model ids, in KEYS' order
-- Returns, per model in order:
--   {state, active_request_leases, queued_requests, error, capacity (slots),
--    manager_leases, queued_managers, loaded_capacity (the pool's advertised
--    capacity while ready, else 0), last_used_ms (end of the last work; 0 = never),
--    retry_at_ms (a failed load's backoff end, 0 = none), retry_in_ms (0 = may load now),
--    worker (the Celery hostname holding the pool while ready, or running the load while
--    loading; '' otherwise), use (the decayed request count now, lib's use_now, as text with 4
--    decimals), resident_ms (how long the pool has been ready, 0 when not ready),
--    registration (the model's published registration, JSON; '' when it is not registered)}
-- so that a status entry's configuration and its state come from the same instant (R4.7).
-- where a 'ready' state whose owner is no longer alive, and a 'loading' state
-- whose loading worker is gone (lib's loader_dead), read as 'unloaded' (R7.4), and
-- 'unloaded' after a failed load (until a load succeeds or the entry changes)
-- reads as 'failed' (R6.7).
local live_prefix = KEYS[#KEYS - 1]
local registrations = KEYS[#KEYS]
local half_life_ms = tonumber(ARGV[1])
local now = now_ms()
local out = {}
for i = 1, #KEYS - 2 do
  local base = KEYS[i]
  local key = base .. ':load'
  local state = redis.call('HGET', key, 'state') or 'unloaded'
  if state == 'ready' then
    local owner = redis.call('HGET', key, 'owner')
    if not owner or redis.call('GET', live_prefix .. owner) ~= redis.call('HGET', key, 'boot') then
      state = 'unloaded'
    end
  elseif state == 'loading' and loader_dead(key, live_prefix, now) then
    state = 'unloaded'
  end
  local retry_at = tonumber(redis.call('HGET', key, 'retry_at_ms') or '0')
  if state == 'unloaded' and retry_at > 0 then state = 'failed' end
  local queued_managers = redis.call('HLEN', base .. ':kind')
  local loaded_capacity, worker, resident = 0, '', 0
  if state == 'ready' then
    loaded_capacity = tonumber(redis.call('HGET', key, 'capacity') or '0')
    worker = redis.call('HGET', key, 'owner') or ''
    resident = math.max(0, now - tonumber(redis.call('HGET', key, 'loaded_at_ms') or now))
  elseif state == 'loading' then
    worker = redis.call('HGET', key, 'loader_host') or ''
  end
  out[i] = {state, redis.call('HLEN', base .. ':leases'),
            redis.call('ZCARD', base .. ':queue') - queued_managers,
            redis.call('HGET', key, 'error') or '', capacity(base),
            redis.call('HLEN', base .. ':mleases'), queued_managers, loaded_capacity,
            tonumber(redis.call('HGET', key, 'last_used_ms') or '0'), retry_at, math.max(0, retry_at - now),
            worker, string.format('%.4f', use_now(base, now, half_life_ms)), resident,
            redis.call('HGET', registrations, ARGV[i + 1]) or ''}
end
return out
