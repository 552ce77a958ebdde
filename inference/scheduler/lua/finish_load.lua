-- finish_load.lua: the single loader publishes the outcome (R4.2).
-- KEYS[1] base key of the model
-- ARGV[1] loader token
-- ARGV[2] outcome: 'ready'; or how the load ended without a pool: 'failed' (the
--         worker reported a failure), 'worker_lost' (the loading worker died, seen by
--         a web process, R7.4) or 'no_worker' (no worker started it in time)
-- ARGV[3] owner (Celery hostname) ARGV[4] owner boot id   ARGV[5] error text
-- ARGV[6] the pool's advertised capacity (slots it could run)
-- Returns 'ok', or 'stale' when another loader took over or the load was
-- abandoned (state no longer 'loading'): nothing changed then.
-- A ready outcome also sets last_used_ms = now (a fresh load is recent work) and
-- loaded_at_ms = now (the start of its minimum residency, R6.1)
-- and forgets earlier failures. Any other outcome is lib's end_load: state
-- 'unloaded', 'ended' = the outcome, and for 'failed' only the backoff (R6.7;
-- begin_load.lua refuses until retry_at_ms; an explicit management load may force).
-- Wakes every waiter registered by begin_load or add_load_waiter ('load:<token>' LF the outcome:
-- 'ready' or '<ended>:<error>') and keeps that outcome for them and the loader (lib's
-- wake_load_waiters, ':loadend'). Clock: redis TIME.
local base = KEYS[1]
local key = base .. ':load'
if redis.call('HGET', key, 'loader') ~= ARGV[1] or redis.call('HGET', key, 'state') ~= 'loading' then
  return 'stale'
end
local now = now_ms()
redis.call('HDEL', key, 'loader_channel')  -- the loader learns this end from its reply (lib's wake_load_waiters)
if ARGV[2] ~= 'ready' then
  end_load(base, ARGV[2], ARGV[5], now)
  return 'ok'
end
redis.call('HSET', key, 'state', 'ready', 'owner', ARGV[3], 'boot', ARGV[4], 'error', '', 'capacity', ARGV[6],
            'last_used_ms', now, 'loaded_at_ms', now)
redis.call('HDEL', key, 'failures', 'retry_at_ms', 'ended', 'loader', 'loader_expires_ms', 'loader_host',
           'loader_boot')
wake_load_waiters(base, 'ready', ARGV[1])
changed(base)
return 'ok'
