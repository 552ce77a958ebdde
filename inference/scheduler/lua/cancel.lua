-- cancel.lua: a waiter gives up its ticket (deadline reached or client gone, R3.2, R8.1).
-- KEYS[1] base key of the model
-- ARGV[1] ticket id     ARGV[2] lease TTL in ms (for tickets the pass grants)
-- ARGV[3] 'release' to give up the ticket wherever it is: a ticket already granted is
--         released in the same step (lib's release_lease, as release.lua), else '' (or absent)
-- Returns 'cancelled' (the ticket left the queue; it never runs),
--         'granted'   (the grant won the race: the caller holds the lease and
--                      must use or release it; not in 'release' mode),
--         'released'  ('release' mode: the grant had won the race and the lease is given back), or
--         'gone'      (neither queued nor leased: already reaped or released).
-- Runs the grant pass: a cancelled manager barrier lets later requests in. Clock: redis TIME.
local base, ticket, ttl_ms = KEYS[1], ARGV[1], tonumber(ARGV[2])
if redis.call('ZREM', base .. ':queue', ticket) == 1 then
  redis.call('HDEL', base .. ':chan', ticket)
  redis.call('HDEL', base .. ':kind', ticket)
  redis.call('HDEL', base .. ':squeue', ticket)
  grant_pass(base, now_ms(), ttl_ms)
  changed(base)
  return 'cancelled'
end
if redis.call('HEXISTS', base .. ':leases', ticket) == 1 or redis.call('HEXISTS', base .. ':mleases', ticket) == 1 then
  if ARGV[3] == 'release' then
    release_lease(base, ticket, now_ms(), ttl_ms)
    return 'released'
  end
  return 'granted'
end
return 'gone'
