-- claim_runtime.lua: record the deployment's runtime, or report the one recorded (R1.4).
-- KEYS[1] the runtime key   ARGV[1] this process's runtime ('legacy' or 'parallel')
-- Returns the runtime recorded after the call (equal to ARGV[1] unless another
-- runtime was recorded first; then nothing changed).
if not redis.call('GET', KEYS[1]) then redis.call('SET', KEYS[1], ARGV[1]) end
return redis.call('GET', KEYS[1])
