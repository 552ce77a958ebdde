-- reap.lua: reclaim leases whose holder stopped renewing them, then grant (R2.5).
-- Called by a waiter when the earliest lease expiry it was told about passes.
-- KEYS[1] base key of the model
-- ARGV[1] lease TTL in ms
-- Returns {reaped_count, next_lease_expiry_ms|-1}.
local base, ttl_ms = KEYS[1], tonumber(ARGV[1])
local now = now_ms()
local reaped = reap(base, now)
grant_pass(base, now, ttl_ms)
return {reaped, next_expiry(base)}
