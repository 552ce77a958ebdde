-- renew.lua: the holder proves it is alive; the lease now expires TTL ms from now (R2.5).
-- KEYS[1] base key of the model
-- ARGV[1] lease id     ARGV[2] lease TTL in ms
-- Returns 1 if renewed, 0 if the lease is no longer held (it was reaped).
local base, lease, ttl_ms = KEYS[1], ARGV[1], tonumber(ARGV[2])
if redis.call('HEXISTS', base .. ':leases', lease) == 0 and redis.call('HEXISTS', base .. ':mleases', lease) == 0 then
  return 0
end
redis.call('ZADD', base .. ':expiry', now_ms() + ttl_ms, lease)
return 1
