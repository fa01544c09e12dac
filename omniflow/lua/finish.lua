-- finish: a session ends (done or failed); ack its task and report to the reconciler.
-- KEYS[1] wf base key  KEYS[2] the stage's task stream  KEYS[3] events stream
-- ARGV[1] group  ARGV[2] task entry id  ARGV[3] stage  ARGV[4] attempt
-- ARGV[5] outcome 'done'|'failed'  ARGV[6] usage JSON (done) or error message (failed)
-- ARGV[7] '1' if the failure is retryable  ARGV[8] now_ms  ARGV[9] last seq emitted
-- ARGV[10] downstream stages csv (an end-of-stream entry goes on each edge)
-- The task is always acked: a fenced session must not be redelivered.
-- Returns 'ok' | 'fenced'
--@include _lib.lua
local wf, stage = KEYS[1], ARGV[3]
local sk = wf .. ':stages'
redis.call('XACK', KEYS[2], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[2], ARGV[2])
local rec = redis.call('HMGET', wf, 'state', 'id')
local cur = redis.call('HMGET', sk, stage, stage .. ':attempt')
if not is_live(rec[1]) or tostring(cur[2]) ~= ARGV[4] then return 'fenced' end
if cur[1] ~= 'running' and cur[1] ~= 'waiting_input' then return 'fenced' end
if ARGV[5] == 'done' then
  for _, dst in ipairs(csv(ARGV[10])) do
    redis.call('XADD', wf .. ':edge:' .. stage .. ':' .. dst, '*', 'eos', '1', 'seq', ARGV[9], 'a', ARGV[4])
  end
  redis.call('HSET', sk, stage, 'done', stage .. ':t_end', ARGV[8], stage .. ':usage', ARGV[6])
else
  redis.call('HSET', sk, stage, 'failed', stage .. ':t_end', ARGV[8], stage .. ':error', ARGV[6])
end
redis.call('XADD', wf .. ':log', '*', 't', 'stage', 'stage', stage, 'status', ARGV[5], 'attempt', ARGV[4])
redis.call('XADD', KEYS[3], '*', 't', ARGV[5], 'wf', rec[2], 's', stage, 'a', ARGV[4], 'd', ARGV[6], 'r', ARGV[7])
return 'ok'
