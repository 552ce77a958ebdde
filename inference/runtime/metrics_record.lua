-- metrics_record.lua: store one batch of metric increments and activity rows (inference.runtime.metrics,
-- _StoreArgs), in one step. One command instead of a MULTI of one command per hash field: the
-- writing process packs one command and parses one reply (docs/benchmarks.md).
-- KEYS: every key the batch touches (metric hashes, the minute hash, the activity list).
-- ARGV[1] i: integer increments   ARGV[2] f: float increments   ARGV[3] e: expiries   ARGV[4] r: activity rows
-- then i triples (key index, field, integer), f triples (key index, field, float as text),
-- e pairs (key index, seconds), and when r > 0: the activity list's key index, how many rows it keeps,
-- the channel its rows are announced on, then the r rows (JSON texts, oldest first).
-- Each row is LPUSHed (newest at the head), the list trimmed to the rows it keeps, and the rows
-- published as one JSON array '[row,...]'. Returns nothing.
local i, f, e, r = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local at = 5
for _ = 1, i do
  redis.call('HINCRBY', KEYS[tonumber(ARGV[at])], ARGV[at + 1], ARGV[at + 2])
  at = at + 3
end
for _ = 1, f do
  redis.call('HINCRBYFLOAT', KEYS[tonumber(ARGV[at])], ARGV[at + 1], ARGV[at + 2])
  at = at + 3
end
for _ = 1, e do
  redis.call('EXPIRE', KEYS[tonumber(ARGV[at])], ARGV[at + 1])
  at = at + 2
end
if r > 0 then
  local list, keep, channel = KEYS[tonumber(ARGV[at])], tonumber(ARGV[at + 1]), ARGV[at + 2]
  local rows = {}
  for n = 1, r do rows[n] = ARGV[at + 2 + n] end
  redis.call('LPUSH', list, unpack(rows))
  redis.call('LTRIM', list, 0, keep - 1)
  redis.call('PUBLISH', channel, '[' .. table.concat(rows, ',') .. ']')
end
