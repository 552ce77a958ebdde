-- load_claim.lua: how the single load claimed by a token is doing (R4.2, R7.4). Reads only.
-- KEYS[1] base key of the model      KEYS[2] worker liveness key prefix
-- ARGV[1] the claim's token
-- Returns {status, left_ms, host}, status one of:
--   'pending'  the token holds the claim and no worker has started the load yet
--   'running'  a worker started it, renews the claim and still beats; left_ms is
--              how long that stays true if the worker stops now (lib's
--              loader_left_ms): the caller looks again then
--   'expired'  a worker started it and is gone (it stopped renewing the claim, or
--              its liveness key expired: it died or froze)
--   'gone'     the token no longer holds the claim (the load finished, was
--              abandoned, or another caller ended or took it over)
-- left_ms is 0 except for 'running'; host is the Celery hostname of the worker that started the load
-- ('running', 'expired'; '' otherwise). Clock: redis TIME.
local key = KEYS[1] .. ':load'
if redis.call('HGET', key, 'state') ~= 'loading' or redis.call('HGET', key, 'loader') ~= ARGV[1] then
  return {'gone', 0, ''}
end
local left = loader_left_ms(key, KEYS[2], now_ms())
if left == nil then return {'pending', 0, ''} end
local host = redis.call('HGET', key, 'loader_host') or ''
if left <= 0 then return {'expired', 0, host} end
return {'running', left, host}
