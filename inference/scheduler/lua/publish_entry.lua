-- publish_entry.lua: publish one model's registration for every process (R4.4, R4.6, R4.7).
-- KEYS[1] base key of the model   KEYS[2] the registry HASH (model id -> JSON)
-- ARGV[1] model id   ARGV[2] registration JSON   ARGV[3] slot count (capacity, >= 1)
-- ARGV[4] the caller's manager lease id ('' = no lease check: start-up sync)
-- ARGV[5] '1' to also mark the model 'unloaded' (a new or changed entry) and forget failed
--         loads (a reconfiguration resets the backoff, R6.7), else '0'
-- Entry and slot count change together: a reader sees the old pair or the new one.
-- Returns 'ok' or 'not_held' (a lease was given but is not held: nothing changed).
local base, registry = KEYS[1], KEYS[2]
local model_id, meta, slots, lease, reset = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
if lease ~= '' and redis.call('HEXISTS', base .. ':mleases', lease) == 0 then return 'not_held' end
redis.call('HSET', registry, model_id, meta)
redis.call('SET', base .. ':cap', slots)
if reset == '1' then
  redis.call('HSET', base .. ':load', 'state', 'unloaded', 'error', '')
  redis.call('HDEL', base .. ':load', 'owner', 'boot', 'capacity', 'failures', 'retry_at_ms')  -- R6.7
end
changed(base)
return 'ok'
