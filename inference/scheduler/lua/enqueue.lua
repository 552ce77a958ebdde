-- enqueue.lua: a request enters the model's FIFO queue (R2.1), with fail-fast (R3.3).
-- KEYS[1] base key of the model      KEYS[2] global FIFO sequence counter
-- ARGV[1] ticket id (becomes the lease id when granted)
-- ARGV[2] reply channel of the waiting process (receives 'grant:<ticket>')
-- ARGV[3] effective busy timeout in ms (0 = unbounded: no fail-fast)
-- ARGV[4] lease TTL in ms
-- Returns one of:
--   {'granted', granted_at_ms}            a slot was free and nobody was queued
--   {'overdue', oldest_lease_age_ms}      every occupied slot has run longer
--                                         than the timeout: refuse at once
--   {'queued', next_lease_expiry_ms|-1, position (1 = head)}
-- Clock: redis TIME.
local base, seq_key = KEYS[1], KEYS[2]
local ticket, chan = ARGV[1], ARGV[2]
local timeout_ms, ttl_ms = tonumber(ARGV[3]), tonumber(ARGV[4])
local now = now_ms()
if reap(base, now) > 0 then grant_pass(base, now, ttl_ms) end

if redis.call('ZCARD', base .. ':queue') == 0 and redis.call('HLEN', base .. ':leases') < capacity(base) then
  grant(base, ticket, now, ttl_ms)
  return {'granted', now}
end

if timeout_ms > 0 then
  local leases = redis.call('HGETALL', base .. ':leases')
  if #leases > 0 then
    local all_overdue, youngest_age = true, nil
    for i = 2, #leases, 2 do
      local age = now - tonumber(leases[i])
      if age <= timeout_ms then all_overdue = false end
      if youngest_age == nil or age < youngest_age then youngest_age = age end
    end
    if all_overdue then return {'overdue', youngest_age} end
  end
end

local seq = redis.call('INCR', seq_key)
redis.call('ZADD', base .. ':queue', seq, ticket)
redis.call('HSET', base .. ':chan', ticket, chan)
return {'queued', next_expiry(base), redis.call('ZCARD', base .. ':queue')}
