-- release.lua: the holder gives its lease back (success, error, disconnect; R2.4).
-- Idempotent: releasing an unknown lease returns 0 and changes nothing.
-- KEYS[1] base key of the model
-- ARGV[1] lease id     ARGV[2] lease TTL in ms (for leases granted by the pass)
-- Returns 1 if the lease (request or manager) was held, else 0. Runs the grant pass.
-- When a lease was held, records the end of work in ':load' last_used_ms
-- (LRU order and idle age, R6.1/R6.4; status reads never write it).
-- A request lease also counts in ':stats' (requests, held_ms) and its hold time
-- (grant -> release, ms) goes to the head of ':held' (the last HELD_KEEP kept), for
-- the UI's request counts and latencies. Publishes a change notice when a lease was held.
local base, lease, ttl_ms = KEYS[1], ARGV[1], tonumber(ARGV[2])
local now = now_ms()
local granted_at = tonumber(redis.call('HGET', base .. ':leases', lease) or '-1')
local held = redis.call('HDEL', base .. ':leases', lease) + redis.call('HDEL', base .. ':mleases', lease)
redis.call('ZREM', base .. ':expiry', lease)
if held > 0 and redis.call('EXISTS', base .. ':load') == 1 then
  redis.call('HSET', base .. ':load', 'last_used_ms', now)
end
if granted_at >= 0 then  -- a request lease: count it and keep its hold time (the UI's latency figures)
  local held_ms = math.max(0, now - granted_at)
  redis.call('HINCRBY', base .. ':stats', 'requests', 1)
  redis.call('HINCRBY', base .. ':stats', 'held_ms', held_ms)
  redis.call('LPUSH', base .. ':held', held_ms)
  redis.call('LTRIM', base .. ':held', 0, HELD_KEEP - 1)
end
if held > 0 then changed(base) end
reap(base, now)
grant_pass(base, now, ttl_ms)
return held
