-- settle_lost_pools.lua: write down in Redis what dead workers left, for every listed model (R7.4):
-- a model 'ready' whose owner's liveness key is gone or names another boot (its worker died, froze
-- past the TTL, or restarted) becomes 'unloaded' (lib's pool_gone, as mark_unloaded.lua); a load in
-- progress whose worker is gone (lib's loader_dead) ends 'worker_lost' with its waiters woken, no
-- backoff (lib's end_load, as begin_load.lua's 'lost'). Snapshots already read such models as
-- 'unloaded'; this makes the stored state say so, so that its caller can record it in the database.
-- Each change happens once, whoever looks first (this script, begin_load.lua, forget_worker.lua).
-- KEYS[1] worker liveness key prefix   KEYS[2..n] base keys of the models to look at
-- ARGV[1] error text of a lost pool
-- Returns {pools, loads}: {base key, worker hostname} pairs of the pools found lost and of the loads
-- ended (the error of a load ended here names its worker, as Scheduler.lost_load_error does).
-- Clock: redis TIME.
local live_prefix = KEYS[1]
local now = now_ms()
local pools, loads = {}, {}
for i = 2, #KEYS do
  local base = KEYS[i]
  local key = base .. ':load'
  local load = redis.call('HMGET', key, 'state', 'owner', 'boot', 'loader_host')
  if load[1] == 'ready' and (not load[2] or redis.call('GET', live_prefix .. load[2]) ~= load[3]) then
    pool_gone(base, ARGV[1])
    pools[#pools + 1] = {base, load[2] or ''}
  elseif load[1] == 'loading' and loader_dead(key, live_prefix, now) then
    end_load(base, 'worker_lost', 'worker ' .. load[4] .. ' was lost while loading the model', now)
    loads[#loads + 1] = {base, load[4]}
  end
end
return {pools, loads}
