-- renew_load.lua: the single loader extends its claim while it works.
-- KEYS[1] base key   ARGV[1] loader token   ARGV[2] loader TTL in ms
-- Returns 1 if still the loader, else 0.
local key = KEYS[1] .. ':load'
if redis.call('HGET', key, 'loader') ~= ARGV[1] or redis.call('HGET', key, 'state') ~= 'loading' then return 0 end
redis.call('HSET', key, 'loader_expires_ms', now_ms() + tonumber(ARGV[2]))
return 1
