-- submit: create, admit and pre-submit one workflow, or refuse with nothing created.
-- KEYS[1] wf base key   `<p>:wf:{id}`
-- KEYS[2] inflight zset `<p>:inflight`
-- KEYS[3] tombstone     `<p>:tomb:<id>`
-- KEYS[4] idempotency   `<p>:idem:<len(tenant)>:<tenant>:<key>` (ignored when ARGV[6] == 0)
-- KEYS[5] all-ids zset  `<p>:all`
-- KEYS[6] tenant index  `<p>:idx:tenant:<tenant>`  KEYS[7] tenant names set `<p>:idx:tenants`
-- ARGV[1] prefix  ARGV[2] id  ARGV[3] now_ms  ARGV[4] deadline_ms
-- ARGV[5] max_in_flight  ARGV[6] idempotency ttl s (0: no key)
-- ARGV[7] required stages csv  ARGV[8] stages submitted at admission csv
-- ARGV[9] n record fields, then that many field/value pairs (the first pair is 'tenant', <tenant>)
-- Returns {'ok', id} | {'existing', id} | {'retired', id} | {'exists', id} | {'busy', n}
--@include _lib.lua
local wf, prefix, id, now = KEYS[1], ARGV[1], ARGV[2], ARGV[3]
local use_idem = tonumber(ARGV[6]) > 0
if use_idem then
  local prev = redis.call('GET', KEYS[4])
  if prev then
    if redis.call('EXISTS', prefix .. ':tomb:' .. prev) == 1 then return {'retired', prev} end
    return {'existing', prev}
  end
end
if redis.call('EXISTS', KEYS[3]) == 1 then return {'retired', id} end
if redis.call('EXISTS', wf) == 1 then return {'exists', id} end
local n = redis.call('ZCARD', KEYS[2])
if n >= tonumber(ARGV[5]) then return {'busy', tostring(n)} end

local nf = tonumber(ARGV[9])
redis.call('HSET', wf, 'id', id, 'state', 'pending', 'created_ms', now, 'updated_ms', now,
  'deadline_ms', ARGV[4], 'finished', '', 'gsub', '', unpack(ARGV, 10, 9 + 2 * nf))
-- every required stage in one HSET; the admitted ones with attempt 1 (they are queued below)
local admit = csv(ARGV[8])
local fields = {}
for _, stage in ipairs(csv(ARGV[7])) do
  local attempt = 0
  if contains(admit, stage) then
    attempt = 1
    fields[#fields + 1] = stage .. ':t_submit'
    fields[#fields + 1] = now
  end
  for _, v in ipairs({stage, 'pending', stage .. ':attempt', attempt, stage .. ':seq', 0}) do
    fields[#fields + 1] = v
  end
end
redis.call('HSET', wf .. ':stages', unpack(fields))
for _, stage in ipairs(admit) do
  redis.call('XADD', prefix .. ':stage:' .. stage .. ':tasks', '*', 'wf', id, 's', stage, 'a', 1)
end
redis.call('ZADD', KEYS[2], ARGV[4], id)
redis.call('ZADD', KEYS[5], now, id)
index_state(prefix, id, nil, 'pending', now)
redis.call('ZADD', KEYS[6], now, id)
redis.call('SADD', KEYS[7], ARGV[11])
redis.call('XADD', wf .. ':log', '*', 't', 'state', 'state', 'pending')
if use_idem then redis.call('SET', KEYS[4], id, 'EX', ARGV[6]) end
return {'ok', id}
