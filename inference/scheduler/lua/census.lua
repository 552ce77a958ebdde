-- census.lua: who serves this deployment, in one read (R7.4; /health). Writes nothing.
-- KEYS[1] HASH of started workers: Celery hostname -> process id (Keys.worker_pid)
-- KEYS[2] worker liveness key prefix (a worker is alive while <prefix><hostname> exists)
-- KEYS[3] STRING present while a supervisor is starting a worker (Keys.worker_starting)
-- KEYS[4] HASH of published registrations (Keys.models_meta)
-- KEYS[5] HASH worker hostname -> the backend its sessions get, 'cpu' or 'cuda' (Keys.worker_backend)
-- Returns {live_workers, starting, models, cuda_workers}: how many workers of KEYS[1] have a liveness
-- key, 1 when KEYS[3] exists (else 0), the number of registrations, and how many of the live workers
-- report 'cuda' in KEYS[5].
-- Cost: one EXISTS (and for a live worker one HGET) per entry of KEYS[1]. That hash stays small: a worker leaves it when it
-- stops cleanly, serve removes a child it saw die, and each starting worker removes the entries
-- whose liveness key is gone (inference/worker/liveness.py).
-- Clock: none (liveness and the starting key expire by their Redis TTLs).
local live_prefix = KEYS[2]
local live, cuda = 0, 0
for _, hostname in ipairs(redis.call('HKEYS', KEYS[1])) do
  if redis.call('EXISTS', live_prefix .. hostname) == 1 then
    live = live + 1
    if redis.call('HGET', KEYS[5], hostname) == 'cuda' then cuda = cuda + 1 end
  end
end
return {live, redis.call('EXISTS', KEYS[3]), redis.call('HLEN', KEYS[4]), cuda}
