-- forget_worker.lua: a worker process is known to be gone (its supervisor saw it exit): forget it in one
-- step (R7.4), instead of waiting for its liveness key to expire.
-- KEYS[1] its liveness key   KEYS[2] the worker pid HASH   KEYS[3] the worker memory HASH
-- KEYS[4..n] base keys of the models to look at (every registered model)
-- ARGV[1] the worker's hostname   ARGV[2] error text of a pool it held   ARGV[3] error text of a load it ran
-- For each model: a pool 'ready' on this worker becomes 'unloaded' with ARGV[2] (lib's pool_gone, as
-- mark_unloaded.lua); a load this worker was running ends as 'worker_lost' with ARGV[3], no backoff, its waiters
-- woken now (finish_load.lua's end, lib's end_load). Then the worker's liveness key and its entries in
-- the pid and memory hashes are deleted.
-- Returns {pools, loads}: the base keys (among KEYS[4..n]) of the models whose pool was on this
-- worker, and of those whose load it was running.
-- Clock: redis TIME.
local host = ARGV[1]
local now = now_ms()
local lost, ended = {}, {}
for i = 4, #KEYS do
  local base = KEYS[i]
  local key = base .. ':load'
  local load = redis.call('HMGET', key, 'state', 'owner', 'loader', 'loader_host')
  if load[1] == 'ready' and load[2] == host then
    pool_gone(base, ARGV[2])
    lost[#lost + 1] = base
  elseif load[1] == 'loading' and load[3] and load[4] == host then
    end_load(base, 'worker_lost', ARGV[3], now)
    ended[#ended + 1] = base
  end
end
redis.call('DEL', KEYS[1])
worker_entries_gone(KEYS[2], KEYS[3], host)
return {lost, ended}
