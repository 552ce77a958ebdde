-- renew_load.lua: the single loader extends its claim while it works.
-- The worker calls it first when the load task starts: a claim that is gone
-- (abandoned because no worker took it in time, or replaced) means "do not load".
-- KEYS[1] base key   ARGV[1] loader token   ARGV[2] loader TTL in ms
-- ARGV[3] hostname of the worker doing the load   ARGV[4] that worker's boot id
-- (with the hostname, names the liveness key that must stay alive, R7.4)
-- Returns 1 if still the loader, else 0. Clock: redis TIME.
local key = KEYS[1] .. ':load'
if redis.call('HGET', key, 'loader') ~= ARGV[1] or redis.call('HGET', key, 'state') ~= 'loading' then return 0 end
if redis.call('HGET', key, 'loader_host') ~= ARGV[3] then changed(KEYS[1]) end  -- a worker took the load
redis.call('HSET', key, 'loader_expires_ms', now_ms() + tonumber(ARGV[2]), 'loader_host', ARGV[3],
           'loader_boot', ARGV[4])
return 1
