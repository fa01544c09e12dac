-- claim: bind a batch of delivered stage tasks to this worker, dropping the ones that are void.
-- The batch may hold the tasks of several stages (a worker serving several stages claims what one
-- read delivered with one call): one group per task stream, the first in KEYS[1] and ARGV[5..].
-- KEYS[1] the first group's task stream (one cell and priority class)  KEYS[2] the cell's listing
--         index of the state running (a pending workflow is in none); then, per task of the group (in ARGV's
--         order), the workflow's wf base key, log, and edge:<src>:<stage> of each upstream stage (all
--         in that cell); then each further group's task stream followed by its tasks' keys, the same
--         way; then, in any order, the `<wf>:stages` of each workflow of before the caller knows of
--         (see stages_known in _lib.lua)
-- ARGV[1] prefix  ARGV[2] group  ARGV[3] replica (worker id)  ARGV[4] now_ms
-- ARGV[5] upstream stages csv ('' for the entry stage)  ARGV[6] stage
-- ARGV[7..] triples: task entry id, workflow id, attempt; then, per further group, '+', its upstream
--         csv, its stage and its triples
-- Tasks of one workflow (its stages' sessions, delivered together) are read with one HMGET of its
-- record and written with one HSET.
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
local CLAIM_REC = {'state', 'input', 'params', 'stages', 'finals', 'created_ms', 'trace', 'tracestate', 'tenant', 'sl'}
local group, replica, now = ARGV[2], ARGV[3], ARGV[4]

-- The groups and their tasks: {stream, stage, upstream, status, {{entry id, workflow id, attempt, wf key}, ...}}
local groups = {}
local reads = {}            -- wf key -> the stage fields its tasks read (with the record's: one HMGET)
local order = {}            -- the wf keys, in the order first seen
do
  local a, k = 5, 1         -- the next ARGV and KEYS positions of the group
  while a <= #ARGV do
    if a > 5 then a = a + 1 end                     -- past the '+' of a further group
    local g = {KEYS[k], ARGV[a + 1], csv(ARGV[a]), 'running', {}}
    if #g[3] > 0 then g[4] = 'waiting_input' end
    k = k + 1
    if k == 2 then k = 3 end                        -- (the index follows the first group's stream)
    a = a + 2
    local stage, upstream = g[2], g[3]
    while a <= #ARGV and ARGV[a] ~= '+' do
      local wf = KEYS[k]
      local t = {ARGV[a], ARGV[a + 1], ARGV[a + 2], wf}
      k = k + 2 + #upstream
      a = a + 3
      g[5][#g[5] + 1] = t
      local sf = list_in(reads, order, wf)
      local n = #sf
      sf[n + 1], sf[n + 2], sf[n + 3], sf[n + 4], sf[n + 5] =
        stage, stage .. ':attempt', stage .. ':seq', stage .. ':replica', stage .. ':ckpt'
      for j = 1, #upstream do
        sf[#sf + 1] = upstream[j]
        sf[#sf + 1] = upstream[j] .. ':seq'
      end
    end
    groups[#groups + 1] = g
  end
end

-- one read per workflow: the record's fields and every stage field its tasks need (a workflow of
-- before: its stage fields from `<wf>:stages`); V[wf][field] = the value (false: not there)
local V = {}
for i = 1, #order do
  local wf = order[i]
  local sf = reads[wf]
  local fields = {}
  local nr = #CLAIM_REC
  for j = 1, nr do fields[j] = CLAIM_REC[j] end
  for j = 1, #sf do fields[nr + j] = sf[j] end
  local got = redis.call('HMGET', wf, unpack(fields))
  local v = {}
  for j = 1, #fields do v[fields[j]] = got[j] end
  local sk = stages_known(wf, v['sl'], v['state'])
  if sk and sk ~= wf then
    got = redis.call('HMGET', sk, unpack(sf))
    for j = 1, #sf do v[sf[j]] = got[j] end
  end
  V[wf] = v
end

local W, WK = {}, {}        -- the fields each hash is written (one HSET per hash at the end), its keys in order
local function write(k, f1, v1, f2, v2, f3, v3)    -- (no vararg table: see hset in _lib.lua)
  local w = list_in(W, WK, k)
  local n = #w
  w[n + 1], w[n + 2], w[n + 3], w[n + 4] = f1, v1, f2, v2
  if f3 ~= nil then w[n + 5], w[n + 6] = f3, v3 end
end

local out = {}
for gi = 1, #groups do
  local g = groups[gi]
  local stream, stage, upstream, status = g[1], g[2], g[3], g[4]
  local tasks = g[5]
  for ti = 1, #tasks do
    local t = tasks[ti]
    local entry_id, id, attempt, wf = t[1], t[2], t[3], t[4]
    local v = V[wf]
    local state = v['state']
    local sk = SKEY[wf]
    local why, held = nil, nil
    local cur, cur_replica
    if not state then
      why = 'gone'
    elseif not is_live(state) then
      why = state
    elseif not sk then
      why = 'layout'
    else
      cur, cur_replica = v[stage], v[stage .. ':replica']
      if v[stage .. ':attempt'] ~= attempt then
        why = 'stale'
      elseif cur ~= 'pending' and not (cur_replica == replica and (cur == 'running' or cur == 'waiting_input')) then
        why = 'stale'
        if (cur == 'running' or cur == 'waiting_input') and cur_replica then held = cur_replica end
      end
    end
    if why == 'layout' then
      out[#out + 1] = {'layout'}
    elseif held then
      -- This attempt runs on another replica, and its task was delivered here too: a failover lost
      -- the delivery (a claim sent again bound the stage without it), or a claim sent again lost the
      -- race to this one. Acked, the running session would have no pending task, and the reconciler
      -- finds a dead worker's sessions by what is pending for it: that replica's death would leave
      -- the stage running forever. So the task is made pending for that replica again.
      redis.call('XCLAIM', stream, group, held, 0, entry_id, 'FORCE', 'JUSTID')
      out[#out + 1] = {'drop', 'held', held}
    elseif why then
      redis.call('XACK', stream, group, entry_id)
      redis.call('XDEL', stream, entry_id)
      out[#out + 1] = {'drop', why}
    else
      if cur == 'pending' then
        write(sk, stage, status, stage .. ':replica', replica, stage .. ':t_start', now)
        v[stage], v[stage .. ':replica'] = status, replica
        if state == 'pending' then     -- the workflow starts too (its record's HSET)
          write(wf, 'state', 'running', 'updated_ms', now)
          v['state'] = 'running'
          index_state(wf, id, nil, 'running', v['created_ms'] or now)
          log_event(key(wf .. ':log'), {'t', 'state', 'state', 'running'})
        end
        log_event(key(wf .. ':log'), {'t', 'stage', 'stage', stage, 'status', status, 'attempt', attempt,
          'replica', replica})
      end
      -- An upstream stage that has stored no step and is not done has written nothing to its edge
      -- (each emit that appends to it stores a step, `<src>:seq`; its done appends the end of stream;
      -- a restart that sets the seq back to 0 deletes the edge with it): nothing to read. (The
      -- client's streamed input, `@input`, has no status: its edge is read.)
      local catchup = {}
      for j = 1, #upstream do
        local src = upstream[j]
        local st, sq = v[src], v[src .. ':seq']
        if st and st ~= 'done' and (sq or '0') == '0' then
          catchup[j] = {src, {}}
        else
          catchup[j] = {src, redis.call('XRANGE', key(wf .. ':edge:' .. src .. ':' .. stage), '-', '+')}
        end
      end
      out[#out + 1] = {'ok', v['input'], v['params'], v['stages'], v['finals'], v[stage .. ':seq'] or '0', catchup,
        v[stage .. ':ckpt'] or '', v['trace'] or '', v['tracestate'] or '', v['tenant'] or ''}
    end
  end
end
for i = 1, #WK do redis.call('HSET', WK[i], unpack(W[WK[i]])) end
flush_log()
return out
