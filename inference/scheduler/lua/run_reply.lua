-- run_reply.lua: a worker answers a run (inference.worker.work.reply), in one step with the check
-- of its stop marker, so a reply nobody will read is never stored (R8.2; run_left.lua is the
-- other side).
-- KEYS[1] the run's reply key (Keys.result)   KEYS[2] its stop marker (Keys.stop)
-- KEYS[3] its input key (Keys.input)          KEYS[4] base key of the model whose lease the reply
--         gives back (when ARGV[5] is set)
-- ARGV[1] the reply (JSON text)   ARGV[2] the wake-up message   ARGV[3] the sender's channel
-- ARGV[4] the reply key's TTL in ms
-- ARGV[5] the lease released with the reply ('' = none: a held run's, or a run the worker never took)
-- ARGV[6] lease TTL in ms (for the grant pass)
-- ARGV[7] '1' when the worker never took the run (a 'not_loaded' reply): its lease is still the sender's
-- The lease of ARGV[5] is released first (lib's release_lease). Then, when the stop marker is set
-- (the client left: run_left.lua), nothing is stored or published; for a run never taken, the
-- lease the marker names ('<base>' LF '<lease>') and the run's input are given back, and the
-- marker is deleted. Otherwise the reply is stored with its TTL and the wake-up published.
-- Returns 1 when the reply was stored and published, 0 when its client had left.
-- Clock: redis TIME.
local now = now_ms()
if ARGV[5] ~= '' then release_lease(KEYS[4], ARGV[5], now, tonumber(ARGV[6])) end
local marker = redis.call('GET', KEYS[2])
if marker then
  if ARGV[7] == '1' then
    local base, lease = string.match(marker, '^(.-)\n(.+)$')
    if base then release_lease(base, lease, now, tonumber(ARGV[6])) end
    redis.call('DEL', KEYS[3])
  end
  redis.call('DEL', KEYS[2])
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', tonumber(ARGV[4]))
redis.call('PUBLISH', ARGV[3], ARGV[2])
return 1
