-- lib.lua: functions shared by every scheduler script (prepended by Python).
--
-- Key layout for one model (base = "<prefix>m:{<model id>}"; the braces are a
-- Redis Cluster hash tag, so one model's keys live on one node):
--   base..':queue'    ZSET  ticket -> FIFO sequence number (global INCR)
--   base..':chan'     HASH  ticket -> pub/sub channel of the waiting process
--   base..':leases'   HASH  lease  -> granted_at_ms (lease id = ticket id)
--   base..':expiry'   ZSET  lease  -> expires_at_ms (renewed by the holder)
--   base..':cap'      STRING capacity (slots); absent = 1
--   base..':load'     HASH  state, owner, boot, loader, loader_expires_ms, error
--   base..':loadwait' HASH  token -> channel of a caller waiting for a load
-- Clock: every script trusts redis.call('TIME') only (milliseconds below).

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
  end
  return #expired
end

local function capacity(base)
  return tonumber(redis.call('GET', base .. ':cap') or '1')
end

local function grant(base, ticket, now, ttl_ms)
  redis.call('HSET', base .. ':leases', ticket, now)
  redis.call('ZADD', base .. ':expiry', now + ttl_ms, ticket)
end

-- Grant queued tickets from the head, in FIFO order, while a slot is free.
-- Each grant is pushed to the waiter's channel as 'grant:<ticket>'.
local function grant_pass(base, now, ttl_ms)
  local cap = capacity(base)
  local granted = 0
  while redis.call('HLEN', base .. ':leases') < cap do
    local head = redis.call('ZRANGE', base .. ':queue', 0, 0)
    if #head == 0 then break end
    local ticket = head[1]
    redis.call('ZREM', base .. ':queue', ticket)
    local chan = redis.call('HGET', base .. ':chan', ticket)
    redis.call('HDEL', base .. ':chan', ticket)
    grant(base, ticket, now, ttl_ms)
    if chan then redis.call('PUBLISH', chan, 'grant:' .. ticket) end
    granted = granted + 1
  end
  return granted
end

-- Earliest lease expiry (ms) or -1 when no lease is held.
local function next_expiry(base)
  local first = redis.call('ZRANGE', base .. ':expiry', 0, 0, 'WITHSCORES')
  if #first == 0 then return -1 end
  return tonumber(first[2])
end
