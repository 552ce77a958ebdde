-- unregister.lua: remove a model's published registration and lifecycle state.
-- KEYS[1] base key of the model   KEYS[2] the registry HASH (model id -> JSON)
-- ARGV[1] model id   ARGV[2] the caller's manager lease id (must be held)
-- The queue and leases stay: the caller still holds its lease and releases it;
-- requests queued behind it find no registration and answer 404. The kept load ends
-- (':loadend:<token>') expire on their own: their tokens are never used again.
-- Returns 'ok' or 'not_held' (nothing changed).
local base, registry = KEYS[1], KEYS[2]
if redis.call('HEXISTS', base .. ':mleases', ARGV[2]) == 0 then return 'not_held' end
redis.call('HDEL', registry, ARGV[1])
redis.call('DEL', base .. ':load', base .. ':cap', base .. ':loadwait', base .. ':stats', base .. ':held')
changed(base)
return 'ok'
