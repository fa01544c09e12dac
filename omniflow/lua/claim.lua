-- claim: bind one delivered stage task to this worker, or drop it.
-- KEYS[1] wf base key  KEYS[2] the stage's task stream  KEYS[3] the worker's wake stream
-- ARGV[1] group  ARGV[2] task entry id  ARGV[3] stage  ARGV[4] attempt
-- ARGV[5] replica (worker id)  ARGV[6] now_ms  ARGV[7] '1' if the stage has inputs
-- Returns {'ok', input, params, stages csv, finals csv, emitted seq}
--       | {'drop', reason}   (task acked and deleted: workflow gone/terminal/tombstoned, or stale attempt)
--@include _lib.lua
local wf, stage = KEYS[1], ARGV[3]
local sk = wf .. ':stages'
local function drop(why)
  redis.call('XACK', KEYS[2], ARGV[1], ARGV[2])
  redis.call('XDEL', KEYS[2], ARGV[2])
  return {'drop', why}
end
local rec = redis.call('HMGET', wf, 'state', 'input', 'params', 'stages', 'finals')
if not rec[1] then return drop('gone') end
if not is_live(rec[1]) then return drop(rec[1]) end
local cur = redis.call('HMGET', sk, stage, stage .. ':attempt', stage .. ':seq')
if tostring(cur[2]) ~= ARGV[4] or cur[1] ~= 'pending' then return drop('stale') end
local status = 'running'
if ARGV[7] == '1' then status = 'waiting_input' end
redis.call('HSET', sk, stage, status, stage .. ':replica', ARGV[5], stage .. ':t_start', ARGV[6])
if rec[1] == 'pending' then
  redis.call('HSET', wf, 'state', 'running', 'updated_ms', ARGV[6])
  redis.call('XADD', wf .. ':log', '*', 't', 'state', 'state', 'running')
end
redis.call('XADD', wf .. ':log', '*', 't', 'stage', 'stage', stage, 'status', status,
  'attempt', ARGV[4], 'replica', ARGV[5])
if ARGV[7] == '1' then
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', '64', '*', 'w', '1')
end
return {'ok', rec[2], rec[3], rec[4], rec[5], cur[3] or '0'}
