-- enqueue_managers.lua: publish one manager ticket on every selected model in
-- one atomic step (bulk unload, CONTRACT R5.1/R5.2). Two overlapping bulk
-- calls are therefore ordered: on every model they share, the first call's
-- ticket is ahead of the second's, so they cannot wait on each other in
-- reverse order. Only this script's own run excludes other publications;
-- requests to unrelated models are not touched.
-- KEYS[1..n] base keys of the selected models (distinct)   KEYS[n+1] FIFO sequence counter
-- ARGV[1] reply channel of the waiting process   ARGV[2] lease TTL in ms
-- ARGV[3..n+2] one ticket id per model, in KEYS order
-- Returns, per model in KEYS order: 1 if granted at once (queue empty and no
-- lease held), else 0 (queued; 'grant:<ticket>' is published when granted).
-- Bulk managers wait without bound (R3.4): there is no fail-fast here.
local n = #KEYS - 1
local seq_key, chan, ttl_ms = KEYS[n + 1], ARGV[1], tonumber(ARGV[2])
local now = now_ms()
local out = {}
for i = 1, n do
  local base, ticket = KEYS[i], ARGV[i + 2]
  if reap(base, now) > 0 or redis.call('ZCARD', base .. ':queue') > 0 then grant_pass(base, now, ttl_ms) end
  if redis.call('ZCARD', base .. ':queue') == 0 and grantable(base, true) then
    grant(base, ticket, now, ttl_ms, true, chan)
    out[i] = 1
  else
    redis.call('ZADD', base .. ':queue', redis.call('INCR', seq_key), ticket)
    redis.call('HSET', base .. ':chan', ticket, chan)
    redis.call('HSET', base .. ':kind', ticket, 'manager')
    changed(base)
    out[i] = 0
  end
end
return out
