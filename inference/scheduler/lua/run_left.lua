-- run_left.lua: the client of a run left while its web process waited for the worker's reply
-- (R8.2, inference.runtime.runs.run_reply). One step, so that with run_reply.lua exactly one side
-- cleans up whatever the order.
-- KEYS[1] the run's reply key (Keys.result)   KEYS[2] its stop marker (Keys.stop)
-- KEYS[3] its input key (Keys.input)          KEYS[4] base key of the run's model
-- ARGV[1] the sender's request lease, still its own until a worker takes the run ('' = a held run,
--         whose lease its sender keeps and releases itself)
-- ARGV[2] the stop marker's TTL in ms   ARGV[3] lease TTL in ms (for the grant pass)
-- Returns one of:
--   'answered'  the reply was already there, unread: it is deleted (nobody will read it); a
--               'not_loaded' reply (the worker never took the run, so the lease was still the
--               sender's) also gives that lease and the run's input back at once
--   'recorded'  as 'answered', for a reply whose worker recorded the answer's metrics itself
--               (its 'recorded' is true, inference.runtime.metrics.answer_events): the sender
--               records nothing more of that run
--   'marked'    no reply yet: the stop marker is set, naming KEYS[4] and ARGV[1] ('<base>' LF
--               '<lease>'; '1' for a held run): an adapter that looks stops its run, and the
--               worker's reply (run_reply.lua) is not stored and does the same clean-up
-- Clock: redis TIME.
local reply = redis.call('GET', KEYS[1])
if reply then
  redis.call('DEL', KEYS[1])
  local ok, decoded = pcall(cjson.decode, reply)
  if ARGV[1] ~= '' and ok and type(decoded) == 'table' and decoded['kind'] == 'not_loaded' then
    release_lease(KEYS[4], ARGV[1], now_ms(), tonumber(ARGV[3]))
    redis.call('DEL', KEYS[3])
  end
  if ok and type(decoded) == 'table' and decoded['recorded'] == true then return 'recorded' end
  return 'answered'
end
local marker = '1'
if ARGV[1] ~= '' then marker = KEYS[4] .. '\n' .. ARGV[1] end
redis.call('SET', KEYS[2], marker, 'PX', tonumber(ARGV[2]))
return 'marked'
