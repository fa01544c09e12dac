-- stage_event: the reconciler applies one stage event to its workflow (idempotent).
-- KEYS[1] wf base key  KEYS[2] inflight zset  KEYS[3] retries zset  KEYS[4] events stream (its cell's)
-- KEYS[5] dead letters of the stage; then every other key it may touch: stages, log, the task stream
--   of every stage (retries, `full`-edge successors), and what finalize may (_lib.lua)
-- ARGV[1] prefix  ARGV[2] type 'done'|'failed'|'lost'  ARGV[3] stage  ARGV[4] attempt
-- ARGV[5] now_ms  ARGV[6] detail (usage JSON or error)  ARGV[7] '1' if retryable
-- ARGV[8] max_attempts of the stage  ARGV[9] retry due ms  ARGV[10] tombstone ttl s
-- ARGV[11] result ttl s  ARGV[12] task stream (lost only)  ARGV[13] task entry id (lost only)
-- ARGV[14] group (lost only)  ARGV[15] events group  ARGV[16] the event's entry id ('' : not from
-- the events stream, e.g. a sweep)  ARGV[17] dead-letter stream MAXLEN (approximate)
-- 'lost' is a session whose worker died: its task is acked here, then it is retried like a failure.
-- The event is acked and deleted here, after it was applied, in the same atomic step: an event
-- whose call was refused (OOM, READONLY...) or failed stays pending and is applied later.
-- Returns {'ignored', why} | {'advanced'} | {'completed', trace} | {'retry', attempt, trace} | {'failed', trace}
--   trace: the workflow's W3C traceparent ('' if none), the parent of the decision's span (omniflow.tracing)
--@include _lib.lua
local wf, prefix, kind, stage, now = KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[5]
local sk = nil          -- where its stage fields are (stages_of, once the record is read)

local function apply()
  if kind == 'lost' and ARGV[13] ~= '' then
    redis.call('XACK', key(ARGV[12]), ARGV[14], ARGV[13])
    redis.call('XDEL', ARGV[12], ARGV[13])
  end
  -- one read of the record (what finalize reads too) and one of the stage hash (the terminal set's too)
  local fields = {'state', 'id', 'stages', 'finals', 'finished', 'groups', 'gsub', 'pipeline_hash', 'trace'}
  for _, f in ipairs(FINAL_REC) do fields[#fields + 1] = f end
  fields[#fields + 1] = 'prio'      -- tasks_key's (a retry, a successor)
  fields[#fields + 1] = stage       -- (the stage's own, when they are in the record: stages_of)
  fields[#fields + 1] = stage .. ':attempt'
  hread(wf, fields)
  sk = stages_of(wf)
  local rec = {}
  for i = 1, 9 do rec[i] = hget(wf, fields[i]) or false end
  if not is_live(rec[1]) then return {'ignored', rec[1] or 'gone'} end
  local id, trace = rec[2], rec[9] or ''
  local sfields = {stage, stage .. ':attempt'}
  for _, s in ipairs(csv(rec[3])) do sfields[#sfields + 1] = s .. ':attempt' end
  hread(sk, sfields)
  local cur = {hget(sk, stage) or false, hget(sk, stage .. ':attempt') or false}
  if tostring(cur[2]) ~= ARGV[4] then return {'ignored', 'stale attempt'} end
  local finished = csv(rec[5])
  if contains(finished, stage) then return {'ignored', 'duplicate'} end

  if kind == 'done' then
    finished[#finished + 1] = stage
    hset(wf, 'finished', table.concat(finished, ','), 'updated_ms', now)
    -- full-edge successors whose producers are all done
    local groups = cjson.decode(rec[6] or '[]')
    local gsub = csv(rec[7])
    for i, g in ipairs(groups) do
      if not contains(gsub, tostring(i)) then
        local ready = true
        for _, dep in ipairs(g['after']) do
          if not contains(finished, dep) then ready = false end
        end
        if ready then
          for _, s in ipairs(g['stages']) do submit_stage(wf, id, s, 1, now, rec[8] or '') end
          gsub[#gsub + 1] = tostring(i)
          hset(wf, 'gsub', table.concat(gsub, ','))
        end
      end
    end
    if not terminal_set_complete(sk, finished, rec[4], rec[3]) then return {'advanced'} end
    finalize(wf, KEYS[2], prefix, id, 'completed', nil, nil, now, ARGV[10], ARGV[11])
    return {'completed', trace}
  end

  -- failed or lost
  if kind == 'failed' and cur[1] ~= 'failed' then return {'ignored', 'not failed'} end
  if kind == 'lost' and stage_terminal(cur[1]) then return {'ignored', 'already ' .. cur[1]} end
  local attempt = tonumber(ARGV[4])
  if ARGV[7] == '1' and attempt < tonumber(ARGV[8]) then
    local nxt = attempt + 1
    hset(sk, stage, 'pending', stage .. ':attempt', nxt, stage .. ':t_submit', now)
    log_event(key(wf .. ':log'), {'t', 'retry', 'stage', stage, 'attempt', tostring(nxt), 'reason', kind .. ': ' .. ARGV[6]})
    if tonumber(ARGV[9]) <= tonumber(now) then
      redis.call('XADD', tasks_key(wf, stage, rec[8] or ''), '*', 'wf', id, 's', stage, 'a', nxt)
    else
      redis.call('ZADD', KEYS[3], ARGV[9], id .. '|' .. stage .. '|' .. nxt)
    end
    return {'retry', tostring(nxt), trace}
  end
  local why = ARGV[6]
  if kind == 'lost' then why = 'worker lost ' .. attempt .. ' time(s): ' .. why end
  redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[17] or '10000', '*', 'wf', id, 's', stage,
    'a', ARGV[4], 'error', why, 'ms', now)
  finalize(wf, KEYS[2], prefix, id, 'failed', 'stage ' .. stage .. ' failed: ' .. why, stage, now, ARGV[10], ARGV[11])
  return {'failed', trace}
end

local res = apply()
hflush()
flush_log()
if ARGV[16] and ARGV[16] ~= '' then
  redis.call('XACK', KEYS[4], ARGV[15], ARGV[16])
  redis.call('XDEL', KEYS[4], ARGV[16])
end
return res
