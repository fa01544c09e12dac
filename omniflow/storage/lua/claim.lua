-- claim: bind a batch of delivered stage tasks to this worker, dropping the ones that are void.
-- KEYS[1] the stage's task stream of one cell and priority class  KEYS[2], KEYS[3] its listing indexes of the states
--         pending and running; then, per task (in ARGV's order), the workflow's wf base key, log,
--         and edge:<src>:<stage> of each upstream stage (all in that cell); then, in any order, the
--         `<wf>:stages` of each workflow of before the caller knows of (see stages_known in _lib.lua)
-- ARGV[1] prefix  ARGV[2] group  ARGV[3] replica (worker id)  ARGV[4] now_ms
-- ARGV[5] upstream stages csv ('' for the entry stage)  ARGV[6] stage
-- ARGV[7..] triples: task entry id, workflow id, attempt
-- Returns one reply per task, in order:
--   {'ok', input, params, stages csv, finals csv, emitted seq, catch-up, checkpoint, trace, tracestate, tenant}
--       catch-up: for each upstream stage, {src, entries of its edge log so far}; entries written
--       after this call reach the worker's inbox instead (see edge_append in _lib.lua)
--       checkpoint: what earlier attempts checkpointed with their steps (emit.lua op 'C'), '' if none
--       trace, tracestate: the W3C context of the request that made the workflow ('' if none;
--       omniflow.tracing)
--       tenant: the workflow's (the slots take tenants in weighted turn)
--   {'layout'}   (nothing written: the workflow is of before, its stage fields in `<wf>:stages`, which
--       this call did not declare; claim it again declaring that key)
--   {'drop', reason}   (task acked and deleted: workflow gone/terminal/tombstoned, or stale attempt)
--       reason held, then a replica: the task of a session that replica runs, delivered again;
--       it stays pending, for that replica (see below)
-- Claiming again a task this replica already holds answers 'ok' again (a retried call is harmless).
--@include _lib.lua
--@const
local CLAIM_REC = {'state', 'input', 'params', 'stages', 'finals', 'created_ms', 'trace', 'tracestate', 'tenant'}
local group, replica, now, stage = ARGV[2], ARGV[3], ARGV[4], ARGV[6]
local upstream = csv(ARGV[5])
local per_task = 2 + #upstream
local status = 'running'
if #upstream > 0 then status = 'waiting_input' end
local out = {}
for i = 7, #ARGV, 3 do
  local entry_id, id, attempt = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local wf = KEYS[4 + (i - 7) / 3 * per_task]
  -- the record's fields and the stage's, with each upstream stage's status and seq (the catch-up
  -- below): one HMGET (read_record)
  local sf = {stage, stage .. ':attempt', stage .. ':seq', stage .. ':replica', stage .. ':ckpt'}
  for j = 1, #upstream do
    local src = upstream[j]
    sf[#sf + 1] = src
    sf[#sf + 1] = src .. ':seq'
  end
  local rec, sk, cur = read_record(wf, CLAIM_REC, sf)
  local why, held = nil, nil
  if not rec[1] then
    why = 'gone'
  elseif not is_live(rec[1]) then
    why = rec[1]
  elseif not sk then
    why = 'layout'
  elseif tostring(cur[2]) ~= attempt then
    why = 'stale'
  elseif cur[1] ~= 'pending' and not (cur[4] == replica and (cur[1] == 'running' or cur[1] == 'waiting_input')) then
    why = 'stale'
    if (cur[1] == 'running' or cur[1] == 'waiting_input') and cur[4] then held = cur[4] end
  end
  if why == 'layout' then
    out[#out + 1] = {'layout'}
  elseif held then
    -- This attempt runs on another replica, and its task was delivered here too: a failover lost
    -- the delivery (a claim sent again bound the stage without it), or a claim sent again lost the
    -- race to this one. Acked, the running session would have no pending task, and the reconciler
    -- finds a dead worker's sessions by what is pending for it: that replica's death would leave
    -- the stage running forever. So the task is made pending for that replica again.
    redis.call('XCLAIM', KEYS[1], group, held, 0, entry_id, 'FORCE', 'JUSTID')
    out[#out + 1] = {'drop', 'held', held}
  elseif why then
    redis.call('XACK', KEYS[1], group, entry_id)
    redis.call('XDEL', KEYS[1], entry_id)
    out[#out + 1] = {'drop', why}
  else
    if cur[1] == 'pending' then
      if rec[1] == 'pending' and sk == wf then      -- the workflow starts too: one HSET
        redis.call('HSET', sk, stage, status, stage .. ':replica', replica, stage .. ':t_start', now,
          'state', 'running', 'updated_ms', now)
      else
        redis.call('HSET', sk, stage, status, stage .. ':replica', replica, stage .. ':t_start', now)
      end
      if rec[1] == 'pending' then
        if sk ~= wf then redis.call('HSET', wf, 'state', 'running', 'updated_ms', now) end
        index_state(wf, id, 'pending', 'running', rec[6] or now)
        redis.call('XADD', key(wf .. ':log'), '*', 't', 'state', 'state', 'running')
      end
      redis.call('XADD', key(wf .. ':log'), '*', 't', 'stage', 'stage', stage, 'status', status,
        'attempt', attempt, 'replica', replica)
    end
    -- An upstream stage that has stored no step and is not done has written nothing to its edge
    -- (each emit that appends to it stores a step, `<src>:seq`; its done appends the end of stream;
    -- a restart that sets the seq back to 0 deletes the edge with it): nothing to read. (The
    -- client's streamed input, `@input`, has no status: its edge is read.)
    local catchup = {}
    for j = 1, #upstream do
      local src = upstream[j]
      local st, sq = cur[4 + 2 * j], cur[5 + 2 * j]
      if st and st ~= 'done' and tostring(sq or '0') == '0' then
        catchup[#catchup + 1] = {src, {}}
      else
        catchup[#catchup + 1] = {src, redis.call('XRANGE', key(wf .. ':edge:' .. src .. ':' .. stage), '-', '+')}
      end
    end
    out[#out + 1] = {'ok', rec[2], rec[3], rec[4], rec[5], cur[3] or '0', catchup, cur[5] or '',
      rec[7] or '', rec[8] or '', rec[9] or ''}
  end
end
return out
