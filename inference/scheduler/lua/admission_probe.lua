-- admission_probe.lua: read a model's published entry and say whether a request sent now would be
-- refused at once (overdue fail-fast, R3.3), in one round trip. Reserves and changes nothing.
-- KEYS[1] base key of the model   KEYS[2] the registry HASH (model id -> JSON)
-- ARGV[1] model id
-- ARGV[2] the request's busy_timeout_ms (-1 = not given)
-- ARGV[3] the server's busy_timeout_ms (the ceiling of a model without its own)
-- The effective timeout follows R3.1 (inference.scheduler.effective_timeout_ms, the same rule):
-- no request value -> the ceiling; ceiling 0 -> the request's; request 0 -> the ceiling;
-- else the smaller. 0 = unbounded (no fail-fast).
-- Returns one of:
--   {'not_found', '', 0, 0, 0}
--   {'overdue', entry JSON, effective timeout ms, youngest holder's age ms, 0}: enqueue.lua would
--        refuse this request at this instant (no expired lease to reclaim first, the request
--        cannot be granted at once, and every occupied slot has run longer than the timeout)
--   {'admit', entry JSON, effective timeout ms, 0, free}: anything else; enqueue.lua decides.
--        free = 1 when nobody is queued and a slot is free: a request enqueued now would be
--        granted at once unless another one gets there first (a hint: the web process then
--        decodes small audio before it queues, in one pool hop, see inference.services.run).
-- enqueue.lua stays the authority: a request the probe admits may still be refused there.
local base, registry = KEYS[1], KEYS[2]
local entry = redis.call('HGET', registry, ARGV[1])
if not entry then return {'not_found', '', 0, 0, 0} end
local request_ms, ceiling_ms = tonumber(ARGV[2]), tonumber(ARGV[3])
local own = cjson.decode(entry)['busy_timeout_ms']
if type(own) == 'number' then ceiling_ms = own end
local timeout_ms
if request_ms < 0 then timeout_ms = ceiling_ms
elseif ceiling_ms == 0 then timeout_ms = request_ms
elseif request_ms == 0 then timeout_ms = ceiling_ms
else timeout_ms = math.min(request_ms, ceiling_ms) end
local now = now_ms()
local free = redis.call('ZCARD', base .. ':queue') == 0 and grantable(base, false)
if free then return {'admit', entry, timeout_ms, 0, 1} end
if timeout_ms == 0 then return {'admit', entry, timeout_ms, 0, 0} end
if #redis.call('ZRANGEBYSCORE', base .. ':expiry', '-inf', now, 'LIMIT', 0, 1) > 0 then
  return {'admit', entry, timeout_ms, 0, 0}  -- enqueue.lua reclaims and grants first: let it decide
end
local n, all_overdue, _, youngest = overdue_stats(base .. ':leases', now, timeout_ms)
if n > 0 and all_overdue then return {'overdue', entry, timeout_ms, youngest, 0} end
return {'admit', entry, timeout_ms, 0, 0}
