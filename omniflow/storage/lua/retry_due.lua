-- retry_due: move one scheduled retry whose time has come onto its stage's task stream.
-- KEYS[1] wf base key  KEYS[2] retries zset of its cell  KEYS[3] its stage hash
-- KEYS[4..] the stage's task streams (the queue of the record's pipeline version: `stage_queue`; every
--         priority class: the record names its own, see tasks_key in _lib.lua)
-- ARGV[1] prefix  ARGV[2] member '<id>|<stage>|<attempt>'  ARGV[3] stage  ARGV[4] attempt
-- Returns 'queued' | 'dropped'
--@include _lib.lua
local wf, stage = KEYS[1], ARGV[3]
if redis.call('ZREM', KEYS[2], ARGV[2]) == 0 then return 'dropped' end
local rec, _, cur = read_record(wf, {'state', 'id', 'pipeline_hash'}, {stage, stage .. ':attempt'})
if not is_live(rec[1]) then return 'dropped' end
if cur[1] ~= 'pending' or tostring(cur[2]) ~= ARGV[4] then return 'dropped' end
redis.call('XADD', tasks_key(wf, stage, rec[3] or ''), '*', 'wf', rec[2], 's', stage, 'a', ARGV[4])
return 'queued'
