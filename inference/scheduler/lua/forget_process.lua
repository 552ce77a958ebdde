-- forget_process.lua: a web process is known to be dead (its supervisor saw it exit, or killed it
-- for a stalled event loop): give back at once what it held, instead of when its liveness key
-- lapses (R7.5, queued tickets) and its leases expire (R2.5, lease_ttl_ms).
-- KEYS[1] the process's liveness key ('<channel>:live')   KEYS[2..n] base keys of the models to look at
-- ARGV[1] the process's pub/sub channel   ARGV[2] lease TTL in ms (for tickets the pass grants)
-- Deletes the liveness key (so no later grant pass grants it anything), drops its queued tickets,
-- releases every lease granted to it (lib's release_lease, as release.lua: the grant pass runs and
-- the next waiters are granted), on every model given.
-- Returns {tickets dropped, leases released}. Clock: redis TIME.
local chan, ttl_ms = ARGV[1], tonumber(ARGV[2])
redis.call('DEL', KEYS[1])
local now = now_ms()
local dropped, released = 0, 0
for i = 2, #KEYS do
  local base = KEYS[i]
  local waiting = redis.call('HGETALL', base .. ':chan')
  for j = 1, #waiting, 2 do
    if waiting[j + 1] == chan then
      redis.call('ZREM', base .. ':queue', waiting[j])
      redis.call('HDEL', base .. ':chan', waiting[j])
      redis.call('HDEL', base .. ':kind', waiting[j])
      redis.call('HDEL', base .. ':squeue', waiting[j])
      dropped = dropped + 1
    end
  end
  local holders = redis.call('HGETALL', base .. ':holder')
  for j = 1, #holders, 2 do
    if holders[j + 1] == chan then
      released = released + release_lease(base, holders[j], now, ttl_ms)
    end
  end
  grant_pass(base, now, ttl_ms)
  changed(base)
end
return {dropped, released}
