-- try_acquire.lua: take a model's manager lease only if that needs no waiting
-- and interrupts nothing (eviction and idle retirement, CONTRACT R6.1/R6.4).
-- KEYS[1] base key of the model
-- ARGV[1] lease id   ARGV[2] lease TTL in ms
-- ARGV[3] required lifecycle state ('' = any), e.g. 'ready'
-- ARGV[4] minimum idle age in ms (0 = any): now - ':load' last_used_ms must be
--         at least this (idle retirement, R6.4)
-- Returns 1 if the manager lease was granted: the model was in the required
-- state, held no lease of any kind and had an empty queue. Else 0. Either
-- way, expired leases are reclaimed and the grant pass runs first (it may
-- grant waiting tickets and drops those of dead processes, R7.5).
local base, lease, ttl_ms, want = KEYS[1], ARGV[1], tonumber(ARGV[2]), ARGV[3]
local idle_ms = tonumber(ARGV[4] or '0')
local now = now_ms()
-- Reclaimed leases and tickets of dead processes (R7.5) must not make a model look busy.
if reap(base, now) > 0 or redis.call('ZCARD', base .. ':queue') > 0 then grant_pass(base, now, ttl_ms) end
if want ~= '' and (redis.call('HGET', base .. ':load', 'state') or 'unloaded') ~= want then return 0 end
if redis.call('ZCARD', base .. ':queue') > 0 or redis.call('HLEN', base .. ':leases') > 0
    or redis.call('HLEN', base .. ':mleases') > 0 then
  return 0
end
if idle_ms > 0 and now - tonumber(redis.call('HGET', base .. ':load', 'last_used_ms') or '0') < idle_ms then
  return 0
end
grant(base, lease, now, ttl_ms, true)
return 1
