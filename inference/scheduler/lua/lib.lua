-- lib.lua: functions shared by every scheduler script (prepended by Python).
--
-- Key layout for one model (base = "<prefix>m:{<model id>}"; the braces are a
-- Redis Cluster hash tag, so one model's keys live on one node):
--   base..':queue'    ZSET  ticket -> FIFO sequence number (global INCR);
--                           requests and managers share this one queue (R2.1)
--   base..':kind'     HASH  ticket -> 'manager' for queued manager tickets
--                           (absent = request)
--   base..':chan'     HASH  ticket -> pub/sub channel of the waiting process;
--                           '<channel>:live' exists while that process lives (R7.5)
--   base..':leases'   HASH  request lease -> granted_at_ms (one slot each)
--   base..':mleases'  HASH  manager lease -> granted_at_ms (the whole model)
--   base..':squeue'   HASH  queued stream ticket -> its stream cap (absent = not a stream): a stream is
--                           granted only while fewer than that many streams of the model hold slots
--   base..':streams'  HASH  stream lease -> granted_at_ms (a stream's lease is a request lease, in
--                           ':leases' too; this hash counts the streams among them)
--   base..':expiry'   ZSET  lease (either kind) -> expires_at_ms (renewed by the holder)
--   base..':holder'   HASH  lease (either kind) -> pub/sub channel of the process it was granted to
--                           (absent for a lease taken without a channel: try_acquire); lets
--                           forget_process.lua give back at once what a dead web process held
--   base..':cap'      STRING capacity (slots); absent = 1
--   base..':load'     HASH  state, owner, boot, loader, loader_expires_ms,
--                           loader_host + loader_boot (the worker running the load),
--                           error, ended (how the last load that did not
--                           succeed ended: 'failed', 'worker_lost' or 'no_worker'),
--                           capacity, last_used_ms,
--                           failures + retry_at_ms (failed loads, R6.7),
--                           use + use_at_ms (recent use: the decayed count of requests
--                           admitted, as of use_at_ms; R6.1, note_use), loaded_at_ms
--                           (when the current pool became ready: minimum residency)
--   base..':loadwait' HASH  token -> channel of a caller waiting for a load
--   base..':loadend:'..token STRING how the load that token waited for (or claimed) ended:
--                           'ready', or '<ended>:<error>' (ended as in ':load'); written when
--                           that load ends, expires LOAD_END_KEEP_MS later (R4.2, R7.4). Tokens are
--                           random and never reused, so unregister leaves these to expire.
--   base..':stats'    HASH  requests (request leases released), held_ms (their summed hold time)
--   base..':held'     LIST  the last HELD_KEEP request hold times in ms (grant -> release), newest first
-- Change notices: every script that changes what a snapshot shows PUBLISHes the model id
-- on '<prefix>changes' (Keys.changes; the prefix is the base key's text before 'm:{'),
-- so a status page follows the scheduler without polling (ui/live.py debounces them).
-- Lease id = ticket id. Clock: every script trusts redis.call('TIME') only
-- (milliseconds below).

-- Backoff after failed loads (R6.7): 1 s after the first, doubling, at most 60 s.
local BACKOFF_FIRST_MS, BACKOFF_MAX_MS = 1000, 60000

-- Request hold times kept per model for the UI's latency figures (release.lua).
local HELD_KEEP = 200

-- Tell status readers that the snapshot of the model at 'base' changed (see the header).
-- One PUBLISH; with nobody subscribed it costs next to nothing.
local function changed(base)
  local prefix, model_id = string.match(base, '^(.*)m:{([^{}]*)}$')
  if prefix then redis.call('PUBLISH', prefix .. 'changes', model_id) end
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Drop leases whose holder stopped renewing them (R2.5). Returns the count.
local function reap(base, now)
  local expired = redis.call('ZRANGEBYSCORE', base .. ':expiry', '-inf', now)
  for _, lease in ipairs(expired) do
    redis.call('ZREM', base .. ':expiry', lease)
    redis.call('HDEL', base .. ':leases', lease)
    redis.call('HDEL', base .. ':mleases', lease)
    redis.call('HDEL', base .. ':streams', lease)
    redis.call('HDEL', base .. ':holder', lease)
  end
  if #expired > 0 then changed(base) end
  return #expired
end

local function capacity(base)
  return tonumber(redis.call('GET', base .. ':cap') or '1')
end

-- is_stream: a request lease that also counts among the model's streams (':streams').
local function grant(base, ticket, now, ttl_ms, is_manager, chan, is_stream)
  redis.call('HSET', base .. (is_manager and ':mleases' or ':leases'), ticket, now)
  if is_stream then redis.call('HSET', base .. ':streams', ticket, now) end
  redis.call('ZADD', base .. ':expiry', now + ttl_ms, ticket)
  if chan then redis.call('HSET', base .. ':holder', ticket, chan) end
  changed(base)
end

-- Can a ticket of this kind be granted now (ignoring queue position)? R2.2:
-- a request needs no management lease and a free slot; a manager needs no
-- lease of any kind; a stream (stream_cap given) is a request that also needs
-- fewer than stream_cap streams holding slots (its mode's admitted count, R9.2).
local function grantable(base, is_manager, stream_cap)
  if redis.call('HLEN', base .. ':mleases') > 0 then return false end
  if is_manager then return redis.call('HLEN', base .. ':leases') == 0 end
  if stream_cap and redis.call('HLEN', base .. ':streams') >= stream_cap then return false end
  return redis.call('HLEN', base .. ':leases') < capacity(base)
end

-- Walk the queue from its head and grant until the first ticket that cannot
-- be granted (R2.2): consecutive requests fill spare slots; a queued manager
-- is a barrier for everything behind it, and so is a stream waiting for its
-- stream cap (FIFO: nothing overtakes it). Each grant is pushed to the waiter's
-- channel as 'grant:<ticket>'. Returns the number granted.
--
-- R7.5: a ticket whose waiting process is dead (its channel's liveness key
-- '<chan>:live' has expired, see listener.py) is dropped, not granted, and
-- the pass goes on with the next: a dead web process's tickets cost nothing.
local function grant_pass(base, now, ttl_ms)
  local granted = 0
  while true do
    local head = redis.call('ZRANGE', base .. ':queue', 0, 0)
    if #head == 0 then break end
    local ticket = head[1]
    local chan = redis.call('HGET', base .. ':chan', ticket)
    local orphan = chan and redis.call('EXISTS', chan .. ':live') == 0
    local is_manager = redis.call('HEXISTS', base .. ':kind', ticket) == 1
    local stream_cap = tonumber(redis.call('HGET', base .. ':squeue', ticket) or '')
    if not orphan and not grantable(base, is_manager, stream_cap) then break end
    redis.call('ZREM', base .. ':queue', ticket)
    redis.call('HDEL', base .. ':kind', ticket)
    redis.call('HDEL', base .. ':squeue', ticket)
    redis.call('HDEL', base .. ':chan', ticket)
    if not orphan then
      grant(base, ticket, now, ttl_ms, is_manager, chan, stream_cap ~= nil)
      if chan then redis.call('PUBLISH', chan, 'grant:' .. ticket) end
      granted = granted + 1
      if is_manager then break end
    end
  end
  return granted
end

-- Earliest lease expiry (ms) or -1 when no lease is held.
local function next_expiry(base)
  local first = redis.call('ZRANGE', base .. ':expiry', 0, 0, 'WITHSCORES')
  if #first == 0 then return -1 end
  return tonumber(first[2])
end

-- Youngest age (ms) among the leases of one hash, and whether all of them
-- are older than timeout_ms. Returns (count, all_overdue, any_overdue, youngest_age).
local function overdue_stats(key, now, timeout_ms)
  local leases = redis.call('HGETALL', key)
  local all_overdue, any_overdue, youngest = true, false, nil
  for i = 2, #leases, 2 do
    local age = now - tonumber(leases[i])
    if age > timeout_ms then any_overdue = true else all_overdue = false end
    if youngest == nil or age < youngest then youngest = age end
  end
  return #leases / 2, all_overdue, any_overdue, youngest or 0
end

-- How long (ms) the load in progress on 'key' (a ':load' hash in state 'loading')
-- stays alive if nothing changes, once a worker started it (loader_host set): the
-- earlier of its claim's expiry and its worker's liveness key's expiry (R7.4);
-- 0 when the claim expired or that key is gone or names another boot (the worker
-- died, froze, or restarted). nil while no worker has started the load (its caller
-- times the pickup).
local function loader_left_ms(key, live_prefix, now)
  local host = redis.call('HGET', key, 'loader_host')
  if not host then return nil end
  local left = tonumber(redis.call('HGET', key, 'loader_expires_ms') or '0') - now
  local boot = redis.call('HGET', key, 'loader_boot')
  if boot then
    local live = live_prefix .. host
    if redis.call('GET', live) ~= boot then return 0 end
    local pttl = redis.call('PTTL', live)
    if pttl >= 0 and pttl < left then left = pttl end
  end
  if left < 0 then return 0 end
  return left
end

-- Is the load in progress on 'key' held by a worker that is gone (R7.4)? See loader_left_ms.
local function loader_dead(key, live_prefix, now)
  local left = loader_left_ms(key, live_prefix, now)
  return left ~= nil and left <= 0
end

-- How long each caller of a load can still read how that load ended (':loadend:<token>', ms): well
-- past the longest a waiter goes without looking (rpc.MAX_CHECK_S, the worker liveness TTL, 10 s).
local LOAD_END_KEEP_MS = 60000

-- The load of 'base' ended ('ready', or '<ended>:<error>'): wake every registered waiter with the
-- outcome inline ('load:<token>' LF outcome, see Listener.expect) and keep the outcome for each of
-- them and for the loader's token (':loadend:<token>', one key each, expiring on its own), so a
-- caller whose wake-up is late or lost, and reads after the next claim overwrote ':load', still
-- learns how *its* load ended. The loader itself is woken too ('load:<loader>' on its
-- 'loader_channel') when someone else ends its load (a supervisor that saw the worker die, a caller
-- that found it dead); finish_load.lua drops that channel first, as the loader or its worker, which
-- answers it with the load's reply, is the one finishing it.
local function wake_load_waiters(base, outcome, loader)
  local waiters = redis.call('HGETALL', base .. ':loadwait')
  for i = 1, #waiters, 2 do
    redis.call('SET', base .. ':loadend:' .. waiters[i], outcome, 'PX', LOAD_END_KEEP_MS)
    redis.call('PUBLISH', waiters[i + 1], 'load:' .. waiters[i] .. '\n' .. outcome)
  end
  if loader then
    redis.call('SET', base .. ':loadend:' .. loader, outcome, 'PX', LOAD_END_KEEP_MS)
    local chan = redis.call('HGET', base .. ':load', 'loader_channel')
    if chan then redis.call('PUBLISH', chan, 'load:' .. loader .. '\n' .. outcome) end
  end
  redis.call('DEL', base .. ':loadwait')
end

-- End the load in progress without a pool (R4.2): state 'unloaded' with 'error',
-- 'ended' = how ('failed': the worker reported a failure; 'worker_lost': the
-- loading worker died; 'no_worker': nobody started it). Only a 'failed' load
-- starts the backoff (R6.7): 'failures' counts consecutive ones and no caller
-- loads again before retry_at_ms = now + min(60 s, 1 s * 2^(failures-1)).
-- Forgets the claim and wakes every waiter with the end (wake_load_waiters).
local function end_load(base, ended, err, now)
  local key = base .. ':load'
  local loader = redis.call('HGET', key, 'loader')
  redis.call('HSET', key, 'state', 'unloaded', 'error', err, 'ended', ended)
  redis.call('HDEL', key, 'owner', 'boot')
  if ended == 'failed' then
    local failures = redis.call('HINCRBY', key, 'failures', 1)
    local delay_ms = math.min(BACKOFF_MAX_MS, BACKOFF_FIRST_MS * 2 ^ (failures - 1))
    redis.call('HSET', key, 'retry_at_ms', now + delay_ms)
  end
  wake_load_waiters(base, ended .. ':' .. err, loader)
  redis.call('HDEL', key, 'loader', 'loader_channel', 'loader_expires_ms', 'loader_host', 'loader_boot')
  changed(base)
end

-- Recent use of a model (R6.1): the count of requests admitted for it, each one decaying by half every
-- half_life_ms (an exponentially decayed request count, in requests; a model asked N times per second
-- for long settles near N * half_life_s / ln 2). Stored as ':load' use (as of use_at_ms), so it
-- survives unloads and evictions. use_now: the count at time 'now' (ms).
local function use_now(base, now, half_life_ms)
  local use = redis.call('HMGET', base .. ':load', 'use', 'use_at_ms')
  local count = tonumber(use[1] or '0') or 0
  if count <= 0 then return 0 end
  return count * 2 ^ (-math.max(0, now - tonumber(use[2] or '0')) / half_life_ms)
end

-- One more request admitted for the model at 'base' (enqueue.lua): its decayed count + 1.
local function note_use(base, now, half_life_ms)
  redis.call('HSET', base .. ':load', 'use', tostring(use_now(base, now, half_life_ms) + 1), 'use_at_ms', now)
end

-- A holder gives its lease back (release.lua; cancel.lua's 'release' mode). Returns 1 if the lease
-- (request or manager) was held, else 0. Records the end of work in ':load' last_used_ms (eviction order
-- and idle age, R6.1/R6.4); a request lease counts in ':stats' and its hold time (grant -> release, ms)
-- goes to the head of ':held' (the last HELD_KEEP kept). Reaps and runs the grant pass.
local function release_lease(base, lease, now, ttl_ms)
  local granted_at = tonumber(redis.call('HGET', base .. ':leases', lease) or '-1')
  local held = redis.call('HDEL', base .. ':leases', lease) + redis.call('HDEL', base .. ':mleases', lease)
  redis.call('HDEL', base .. ':streams', lease)
  redis.call('ZREM', base .. ':expiry', lease)
  redis.call('HDEL', base .. ':holder', lease)
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
end

-- A loaded pool is gone (its worker died, stopped or lost it; R7.4): state 'unloaded' with ``err``,
-- owner forgotten (mark_unloaded.lua, forget_worker.lua).
local function pool_gone(base, err)
  local key = base .. ':load'
  redis.call('HSET', key, 'state', 'unloaded', 'error', err)
  redis.call('HDEL', key, 'owner', 'boot')
  changed(base)
end

-- Remove worker ``host`` from the worker registry: its entries in the pid and memory HASHes
-- (forget_worker.lua, forget_departed.lua, worker_leave.lua; the caller deletes its liveness key).
local function worker_entries_gone(pid_key, memory_key, host)
  redis.call('HDEL', pid_key, host)
  redis.call('HDEL', memory_key, host)
end
