-- load_claim.lua: how the single load claimed by a token is doing (R4.2, R7.4). Reads only.
-- KEYS[1] base key of the model
-- ARGV[1] the claim's token
-- Returns one of:
--   'pending'  the token holds the claim and no worker has started the load yet
--   'running'  a worker started it and keeps renewing the claim (not expired in Redis time)
--   'expired'  a worker started it and stopped renewing: the worker died or froze
--   'gone'     the token no longer holds the claim (the load finished, was
--              abandoned, or another loader took over)
local key = KEYS[1] .. ':load'
if redis.call('HGET', key, 'state') ~= 'loading' or redis.call('HGET', key, 'loader') ~= ARGV[1] then
  return 'gone'
end
if not redis.call('HGET', key, 'loader_host') then return 'pending' end
if tonumber(redis.call('HGET', key, 'loader_expires_ms') or '0') <= now_ms() then return 'expired' end
return 'running'
