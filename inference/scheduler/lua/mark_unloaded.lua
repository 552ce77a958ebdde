-- mark_unloaded.lua: record that a loaded pool is gone (its worker died or lost it; R7.4).
-- KEYS[1] base key   ARGV[1] boot id the caller saw   ARGV[2] error text
-- Only a 'ready' state with that boot id changes. Returns 1 if changed, else 0.
local key = KEYS[1] .. ':load'
if redis.call('HGET', key, 'state') ~= 'ready' or redis.call('HGET', key, 'boot') ~= ARGV[1] then return 0 end
pool_gone(KEYS[1], ARGV[2])
return 1
