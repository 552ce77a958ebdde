-- set_state.lua: a manager records a lifecycle state of the model it holds (R4.4, R4.5).
-- KEYS[1] base key of the model
-- ARGV[1] new state: 'unloading', 'reconfiguring' or 'unloaded'
-- ARGV[2] error text ('' clears it, except a failed load's error while its backoff is remembered, R6.7)
-- ARGV[3] the caller's manager lease id (must be held: only the manager changes state)
-- Allowed transitions (anything else changes nothing):
--   any state                       -> unloading | reconfiguring   (teardown begins;
--                                      the owner and any loader claim are forgotten,
--                                      so the logical residency is cleared first).
--                                      From unloading/reconfiguring this is a teardown
--                                      whose manager died before it ended: the caller
--                                      holds the exclusive lease now, so that one is over.
--   unloading | reconfiguring | unloaded -> unloaded              (teardown ends)
-- Refused: ready | loading -> unloaded (a teardown must begin first).
-- A model with no ':load' hash reads as 'unloaded'.
-- Returns {'ok', owner, boot}: the worker whose pool the model had (its Celery hostname and boot id,
-- '' when none), read in the same step that forgets it (a teardown begun goes on to destroy that
-- pool); or 'not_held' (the lease is not a held manager lease of this model: it was reaped or never
-- granted) or 'bad_transition'.
local base = KEYS[1]
local key = base .. ':load'
local want, err, lease = ARGV[1], ARGV[2], ARGV[3]
if redis.call('HEXISTS', base .. ':mleases', lease) == 0 then return 'not_held' end
local state = redis.call('HGET', key, 'state') or 'unloaded'
local begins = want == 'unloading' or want == 'reconfiguring'
local ends = want == 'unloaded' and (state == 'unloading' or state == 'reconfiguring' or state == 'unloaded')
if not (begins or ends) then return 'bad_transition' end
local pool = redis.call('HMGET', key, 'owner', 'boot')
-- An unload does not forget a failed load (R6.7): its error stays while its backoff is remembered.
if err == '' and redis.call('HEXISTS', key, 'retry_at_ms') == 1 then
  redis.call('HSET', key, 'state', want)
else
  redis.call('HSET', key, 'state', want, 'error', err)
end
redis.call('HDEL', key, 'owner', 'boot', 'loader', 'loader_channel', 'loader_expires_ms', 'loader_host', 'loader_boot',
           'capacity')
changed(base)
return {'ok', pool[1] or '', pool[2] or ''}
