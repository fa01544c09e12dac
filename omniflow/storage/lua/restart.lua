-- restart: a retried session of a stage that cannot resume starts its output over, and so does
-- every stage downstream of it (they consumed output that will now differ). Fenced.
-- Also "regenerate": a consuming session that cannot read the output of `stage` (its chunks were
-- in the shared memory of a host it cannot map, or are gone) asks for `stage` itself to run again,
-- fenced by its own attempt; `stage` and everything downstream of it start over with a new attempt.
-- KEYS[1] wf base key; then its stage hash, log, edge:<a>:<b> of each edge in ARGV[6], out:<s> of the
--   stage and each downstream one, and the task stream (of its cell) of each stage it re-queues
-- ARGV[1] prefix  ARGV[2] stage  ARGV[3] its attempt (regenerate: '')  ARGV[4] now_ms
-- ARGV[5] downstream stages of this workflow, transitively, csv
-- ARGV[6] edges to clear, csv of '<src>:<dst>' (the stage's and its downstream stages' outgoing edges)
-- ARGV[7] regenerate only: the consuming stage that asks (one of ARGV[5])  ARGV[8] its attempt
-- ARGV[9] regenerate only: the most attempts `stage` may have (its retry policy)  ARGV[10] why
-- Every downstream stage already submitted starts again with a new attempt, whatever its status: one
-- that had finished consumed the output being replaced, and its consumers wait on the edges cleared
-- here (it leaves `finished` until it finishes again).
-- Returns 'ok' | 'fenced' | 'exhausted' (regenerate: `stage` has used its attempts; nothing changed)
--@include _lib.lua
local wf, stage, now = KEYS[1], ARGV[2], ARGV[4]
local by = ARGV[7] or ''
local rec, sk, cur = read_record(wf, {'state', 'id', 'finished', 'pipeline_hash'}, {stage, stage .. ':attempt'})
if not is_live(rec[1]) then return 'fenced' end
local fence = by ~= '' and redis.call('HMGET', sk, by, by .. ':attempt') or cur
local fence_attempt = by ~= '' and ARGV[8] or ARGV[3]
if tostring(fence[2]) ~= fence_attempt then return 'fenced' end
if fence[1] ~= 'running' and fence[1] ~= 'waiting_input' then return 'fenced' end
if by ~= '' and (tonumber(cur[2]) or 0) >= tonumber(ARGV[9]) then return 'exhausted' end
local id = rec[2]
for _, edge in ipairs(csv(ARGV[6])) do
  redis.call('UNLINK', key(wf .. ':edge:' .. edge))
end
local cleared = {stage}
for _, s in ipairs(csv(ARGV[5])) do cleared[#cleared + 1] = s end
for _, s in ipairs(cleared) do
  redis.call('UNLINK', key(wf .. ':out:' .. s))
  redis.call('HSET', sk, s .. ':seq', 0, s .. ':samples', 0, s .. ':ckpt', '', s .. ':text', '')
end
-- downstream sessions already submitted start again with a new attempt (the old ones are fenced)
-- (regenerate: `stage` too, its session being another worker's or over)
local finished, kept = csv(rec[3]), {}
for i = (by ~= '' and 1 or 2), #cleared do
  local s = cleared[i]
  local attempt = tonumber(redis.call('HGET', sk, s .. ':attempt')) or 0
  if attempt > 0 then
    submit_stage(wf, id, s, attempt + 1, now, rec[4] or '')
    local reason = i == 1 and ('its output cannot be read by ' .. by .. ': ' .. (ARGV[10] or ''))
      or ('upstream ' .. stage .. ' restarted')
    log_event(key(wf .. ':log'), {'t', 'retry', 'stage', s, 'attempt', tostring(attempt + 1), 'reason', reason})
  end
end
for _, s in ipairs(finished) do
  if not contains(cleared, s) then kept[#kept + 1] = s end
end
if #kept ~= #finished then
  redis.call('HSET', wf, 'finished', table.concat(kept, ','))
end
if by == '' then
  log_event(key(wf .. ':log'), {'t', 'restart', 'stage', stage, 'attempt', ARGV[3], 'stages', table.concat(cleared, ',')})
else
  log_event(key(wf .. ':log'), {'t', 'restart', 'stage', stage, 'attempt', tostring(cur[2]),
    'stages', table.concat(cleared, ','), 'by', by})
end
flush_log()
return 'ok'
