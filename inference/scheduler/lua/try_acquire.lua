-- try_acquire.lua: take a model's manager lease only if that needs no waiting
-- and interrupts nothing (eviction and idle retirement, CONTRACT R6.1/R6.4).
-- KEYS[1] base key of the model
-- ARGV[1] lease id   ARGV[2] lease TTL in ms
-- ARGV[3] required lifecycle state ('' = any), e.g. 'ready'
-- ARGV[4] minimum idle age in ms (0 = any): now - ':load' last_used_ms must be
--         at least this (idle retirement, R6.4)
-- Eviction by recent use (R6.1) adds two conditions, checked in the same step:
-- ARGV[5] minimum residency in ms (0 = any): the current pool must have been ready this long
--         (now - ':load' loaded_at_ms)
-- ARGV[6] use bound ('' = any): the model's decayed request count now (lib's use_now) must be
--         below this   ARGV[7] half-life of that count in ms
-- Returns 1 if the manager lease was granted: the model was in the required
-- state, held no lease of any kind, had an empty queue and met ARGV[4..6]. Else 0. Either
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
local min_resident_ms = tonumber(ARGV[5] or '0')
local loaded_at = tonumber(redis.call('HGET', base .. ':load', 'loaded_at_ms') or '0')
if min_resident_ms > 0 and now - loaded_at < min_resident_ms then return 0 end
if (ARGV[6] or '') ~= '' and use_now(base, now, tonumber(ARGV[7])) >= tonumber(ARGV[6]) then return 0 end
grant(base, lease, now, ttl_ms, true)
return 1
