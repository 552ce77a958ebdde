-- publish_registry.lua: replace the whole published registry at start-up (sync_config).
-- KEYS[1] the registry HASH (model id -> JSON)   KEYS[2] the runtime key
-- KEYS[3..] base keys of the models, in the order of the triples below
-- ARGV[1] runtime name ('legacy' or 'parallel')
-- ARGV[2..] triples: model id, registration JSON, slot count
-- A model whose published JSON changed is marked 'unloaded' with error
-- 'configuration changed' so the next request loads the new configuration.
-- Ids no longer listed disappear from the registry. Returns the number published.
local registry, runtime_key = KEYS[1], KEYS[2]
local previous = {}
local flat = redis.call('HGETALL', registry)
for i = 1, #flat, 2 do previous[flat[i]] = flat[i + 1] end
redis.call('DEL', registry)
local n = 0
for i = 2, #ARGV, 3 do
  local model_id, meta, slots = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local base = KEYS[3 + n]
  redis.call('HSET', registry, model_id, meta)
  redis.call('SET', base .. ':cap', slots)
  if previous[model_id] and previous[model_id] ~= meta then
    redis.call('HSET', base .. ':load', 'state', 'unloaded', 'error', 'configuration changed')
  end
  n = n + 1
  changed(base)
end
redis.call('SET', runtime_key, ARGV[1])
return n
