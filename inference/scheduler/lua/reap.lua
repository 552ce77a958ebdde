-- reap.lua: reclaim leases whose holder stopped renewing them, then grant (R2.5).
-- Called by a waiter when the earliest lease expiry it was told about passes.
-- KEYS[1] base key of the model
-- ARGV[1] lease TTL in ms    ARGV[2] the calling waiter's ticket ('' for none)
-- Returns {reaped_count, next_lease_expiry_ms|-1, ticket_status, now_ms} where
-- ticket_status is 'queued', 'granted' (the waiter holds a lease: its wake-up
-- may have been lost with a dropped subscription) or 'gone'.
local base, ttl_ms, ticket = KEYS[1], tonumber(ARGV[1]), ARGV[2]
local now = now_ms()
local reaped = reap(base, now)
grant_pass(base, now, ttl_ms)
local status = 'gone'
if ticket ~= '' then
  if redis.call('ZSCORE', base .. ':queue', ticket) then
    status = 'queued'
  elseif redis.call('HEXISTS', base .. ':leases', ticket) == 1
      or redis.call('HEXISTS', base .. ':mleases', ticket) == 1 then
    status = 'granted'
  end
end
return {reaped, next_expiry(base), status, now}
