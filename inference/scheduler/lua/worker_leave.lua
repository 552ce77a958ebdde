-- worker_leave.lua: a worker that stops deletes its liveness key and its registry entries, only if the
-- key still holds its own boot id (a worker with the same hostname that started since keeps its own).
-- KEYS[1] its liveness key   KEYS[2] the worker pid HASH   KEYS[3] the worker memory HASH
-- ARGV[1] its hostname   ARGV[2] its boot id
-- Returns 1 if the worker's entries were deleted, else 0.
if redis.call('GET', KEYS[1]) ~= ARGV[2] then return 0 end
redis.call('DEL', KEYS[1])
worker_entries_gone(KEYS[2], KEYS[3], ARGV[1])
return 1
