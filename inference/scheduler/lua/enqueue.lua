-- enqueue.lua: a request or a manager enters the model's FIFO queue (R2.1),
-- with fail-fast (R3.3 requests, R3.4 managers).
-- KEYS[1] base key of the model      KEYS[2] global FIFO sequence counter
-- KEYS[3] published registrations (HASH)   KEYS[4] worker liveness key prefix
-- ARGV[1] ticket id (becomes the lease id when granted)
-- ARGV[2] reply channel of the waiting process (receives 'grant:<ticket>')
-- ARGV[3] effective busy timeout in ms (0 = unbounded: no fail-fast)
-- ARGV[4] lease TTL in ms
-- ARGV[5] kind: 'request' (one slot), 'manager' (the whole model) or 'stream:<cap>' (one slot, granted
--         only while fewer than <cap> streams of the model hold slots: its mode's admitted count)
-- ARGV[6] the model id (its field in KEYS[3])
-- ARGV[7] half-life of the recent-use count in ms: a request for a registered model (listed in
--         KEYS[3]) adds one to the model's decayed request count (lib's note_use, R6.1), whatever
--         the answer (a refused request was demand too)
-- A request may offer its run, to be handed to the worker in the grant's own step:
-- KEYS[5] run queue key prefix (the worker's queue is KEYS[5] .. owner .. ':' .. boot)
-- ARGV[8] the registration (JSON text) the run was prepared for
-- ARGV[9] the run queue element (header naming lease id = ARGV[1], and its input)
-- ARGV[10] the run queue's TTL in ms
-- Returns one of:
--   {'granted', granted_at_ms, meta, owner, boot, dispatched}
--                                         nobody queued and the kind is grantable;
--                                         meta: the model's published registration
--                                         (JSON, '' when unregistered) read in the
--                                         same step as the grant; owner/boot: where
--                                         its pool is ready on a live worker, as
--                                         begin_load's 'ready' says ('' when not);
--                                         dispatched 1: the offered run was pushed
--                                         on that worker's queue (ready, and meta is
--                                         exactly ARGV[8]), else 0
--   {'overdue', age_ms}                   refused at once: for a request, every
--                                         occupied slot has run longer than the
--                                         timeout (unoccupied slots are ignored);
--                                         for a manager, some occupied slot or
--                                         held manager lease has; for a stream, also
--                                         when <cap> streams run and every one has
--   {'queued', next_lease_expiry_ms|-1, position (1 = head), now_ms}
-- Clock: redis TIME.
local base, seq_key = KEYS[1], KEYS[2]
local ticket, chan = ARGV[1], ARGV[2]
local timeout_ms, ttl_ms = tonumber(ARGV[3]), tonumber(ARGV[4])
local kind, cap = string.match(ARGV[5], '^(%a+):?(%d*)$')
local is_manager = kind == 'manager'
local stream_cap = kind == 'stream' and tonumber(cap) or nil
local now = now_ms()
if not is_manager and redis.call('HEXISTS', KEYS[3], ARGV[6]) == 1 then note_use(base, now, tonumber(ARGV[7])) end
-- A grant pass when leases were reclaimed, or when tickets wait (R7.5: tickets of dead
-- processes are dropped, so a live caller never queues behind them alone).
if reap(base, now) > 0 or redis.call('ZCARD', base .. ':queue') > 0 then grant_pass(base, now, ttl_ms) end

if redis.call('ZCARD', base .. ':queue') == 0 and grantable(base, is_manager, stream_cap) then
  grant(base, ticket, now, ttl_ms, is_manager, chan, stream_cap ~= nil)
  local meta = redis.call('HGET', KEYS[3], ARGV[6]) or ''
  local owner, boot = '', ''
  local load = redis.call('HMGET', base .. ':load', 'state', 'owner', 'boot')
  if load[1] == 'ready' and load[2] and redis.call('GET', KEYS[4] .. load[2]) == load[3] then
    owner, boot = load[2], load[3]
  end
  local dispatched = 0
  if owner ~= '' and KEYS[5] and meta == ARGV[8] then
    local queue = KEYS[5] .. owner .. ':' .. boot
    redis.call('LPUSH', queue, ARGV[9])
    redis.call('PEXPIRE', queue, tonumber(ARGV[10]))
    dispatched = 1
  end
  return {'granted', now, meta, owner, boot, dispatched}
end

if timeout_ms > 0 then
  local n, all_overdue, any_overdue, youngest = overdue_stats(base .. ':leases', now, timeout_ms)
  if is_manager then
    local mn, _, m_any, m_youngest = overdue_stats(base .. ':mleases', now, timeout_ms)
    if any_overdue or m_any then return {'overdue', math.max(youngest, m_youngest)} end
  elseif n > 0 and all_overdue then
    return {'overdue', youngest}
  elseif stream_cap then
    local sn, s_all, _, s_youngest = overdue_stats(base .. ':streams', now, timeout_ms)
    if sn >= stream_cap and s_all then return {'overdue', s_youngest} end
  end
end

local seq = redis.call('INCR', seq_key)
redis.call('ZADD', base .. ':queue', seq, ticket)
redis.call('HSET', base .. ':chan', ticket, chan)
if is_manager then redis.call('HSET', base .. ':kind', ticket, 'manager') end
if stream_cap then redis.call('HSET', base .. ':squeue', ticket, stream_cap) end
changed(base)
return {'queued', next_expiry(base), redis.call('ZCARD', base .. ':queue'), now}
