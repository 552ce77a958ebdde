-- mark_unloaded.lua: record that a loaded pool is gone (its worker died or lost it; R7.4).
-- KEYS[1] base key   ARGV[1] boot id the caller saw   ARGV[2] error text
-- Only a 'ready' state with that boot id changes. Returns 1 if changed, else 0.
local key = KEYS[1] .. ':load'
if redis.call('HGET', key, 'state') ~= 'ready' or redis.call('HGET', key, 'boot') ~= ARGV[1] then return 0 end
redis.call('HSET', key, 'state', 'unloaded', 'error', ARGV[2])
redis.call('HDEL', key, 'owner', 'boot')
changed(KEYS[1])
return 1
