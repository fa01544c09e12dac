-- restart: a retried session of a stage that cannot resume starts its output over, and so does
-- every stage downstream of it (they consumed output that will now differ). Fenced.
-- KEYS[1] wf base key; then its stage hash, log, edge:<a>:<b> of each edge in ARGV[6], out:<s> of the
--   stage and each downstream one, and the task stream (of its cell) of each downstream stage
-- ARGV[1] prefix  ARGV[2] stage  ARGV[3] its attempt  ARGV[4] now_ms
-- ARGV[5] downstream stages of this workflow, transitively, csv
-- ARGV[6] edges to clear, csv of '<src>:<dst>' (the stage's and its downstream stages' outgoing edges)
-- Every downstream stage already submitted starts again with a new attempt, whatever its status: one
-- that had finished consumed the output being replaced, and its consumers wait on the edges cleared
-- here (it leaves `finished` until it finishes again).
-- Returns 'ok' | 'fenced'
--@include _lib.lua
local wf, stage, now = KEYS[1], ARGV[2], ARGV[4]
local sk = key(wf .. ':stages')
local rec = redis.call('HMGET', wf, 'state', 'id', 'finished')
local cur = redis.call('HMGET', sk, stage, stage .. ':attempt')
if not is_live(rec[1]) or tostring(cur[2]) ~= ARGV[3] then return 'fenced' end
if cur[1] ~= 'running' and cur[1] ~= 'waiting_input' then return 'fenced' end
local id = rec[2]
for _, edge in ipairs(csv(ARGV[6])) do
  redis.call('UNLINK', key(wf .. ':edge:' .. edge))
end
local cleared = {stage}
for _, s in ipairs(csv(ARGV[5])) do cleared[#cleared + 1] = s end
for _, s in ipairs(cleared) do
  redis.call('UNLINK', key(wf .. ':out:' .. s))
  redis.call('HSET', sk, s .. ':seq', 0, s .. ':samples', 0, s .. ':ckpt', '')
end
-- downstream sessions already submitted start again with a new attempt (the old ones are fenced)
local finished, kept = csv(rec[3]), {}
for i = 2, #cleared do
  local s = cleared[i]
  local attempt = tonumber(redis.call('HGET', sk, s .. ':attempt')) or 0
  if attempt > 0 then
    submit_stage(wf, id, s, attempt + 1, now)
    redis.call('XADD', key(wf .. ':log'), '*', 't', 'retry', 'stage', s, 'attempt', tostring(attempt + 1),
      'reason', 'upstream ' .. stage .. ' restarted')
  end
end
for _, s in ipairs(finished) do
  if not contains(cleared, s) then kept[#kept + 1] = s end
end
if #kept ~= #finished then
  redis.call('HSET', wf, 'finished', table.concat(kept, ','))
end
redis.call('XADD', key(wf .. ':log'), '*', 't', 'restart', 'stage', stage, 'attempt', ARGV[3],
  'stages', table.concat(cleared, ','))
return 'ok'
