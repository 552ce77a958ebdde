-- forget_departed.lua: drop the registry entries of workers whose liveness key is gone (a worker that
-- died without cleaning up: its pid and available memory would stay listed forever). Run by a worker
-- as it starts.
-- KEYS[1] the worker pid HASH   KEYS[2] the worker memory HASH   KEYS[3] worker liveness key prefix
-- KEYS[4] the worker backend HASH
-- Returns the hostnames whose entries were dropped. Tolerated race: a worker only frozen past its
-- liveness TTL adds itself back at its next beat.
local departed = {}
for _, host in ipairs(redis.call('HKEYS', KEYS[1])) do
  if redis.call('EXISTS', KEYS[3] .. host) == 0 then
    worker_entries_gone(KEYS[1], KEYS[2], host)
    redis.call('HDEL', KEYS[4], host)
    departed[#departed + 1] = host
  end
end
return departed
