-- emit: write one output step of a session (fenced, idempotent on seq).
-- KEYS[1] wf base key
-- ARGV[1] stage  ARGV[2] attempt  ARGV[3] seq (0: no output, status change only)
-- ARGV[4] new stage status or ''  ARGV[5] now_ms
-- ARGV[6..] ops, applied in order:
--   'X', key suffix, n, f1, v1, ... fn, vn   XADD <wf><suffix> * fields
--   'A', key suffix, value                    APPEND <wf><suffix> value
--   'H', field, value                         HSET stages field value
--   'I', field, increment                     HINCRBY stages field increment
-- Returns 'ok' | 'dup' (seq already written: nothing done) | 'fenced' (session no longer owns the stage)
local wf, stage = KEYS[1], ARGV[1]
local sk = wf .. ':stages'
if redis.call('HGET', wf, 'state') ~= 'running' then return 'fenced' end
local cur = redis.call('HMGET', sk, stage, stage .. ':attempt', stage .. ':seq')
if tostring(cur[2]) ~= ARGV[2] then return 'fenced' end
if cur[1] ~= 'running' and cur[1] ~= 'waiting_input' then return 'fenced' end
if ARGV[4] ~= '' and cur[1] ~= ARGV[4] then
  redis.call('HSET', sk, stage, ARGV[4])
  redis.call('XADD', wf .. ':log', '*', 't', 'stage', 'stage', stage, 'status', ARGV[4], 'attempt', ARGV[2])
end
local seq = tonumber(ARGV[3])
if seq == 0 then return 'ok' end
if seq <= tonumber(cur[3] or '0') then return 'dup' end
redis.call('HSET', sk, stage .. ':seq', seq)
local i = 6
while i <= #ARGV do
  local op = ARGV[i]
  if op == 'X' then
    local n = tonumber(ARGV[i + 2])
    redis.call('XADD', wf .. ARGV[i + 1], '*', unpack(ARGV, i + 3, i + 2 + 2 * n))
    i = i + 3 + 2 * n
  elseif op == 'A' then
    redis.call('APPEND', wf .. ARGV[i + 1], ARGV[i + 2])
    i = i + 3
  elseif op == 'H' then
    redis.call('HSET', sk, ARGV[i + 1], ARGV[i + 2])
    i = i + 3
  elseif op == 'I' then
    redis.call('HINCRBY', sk, ARGV[i + 1], ARGV[i + 2])
    i = i + 3
  else
    return redis.error_reply('emit: unknown op ' .. tostring(op))
  end
end
return 'ok'
