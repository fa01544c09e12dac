-- Shared helpers, spliced into scripts that say `--@include _lib.lua`.
-- Every script derives a workflow's sub-keys from its base key KEYS[1]
-- (`<prefix>:wf:{<id>}`): they share the hash tag, so one cluster slot.

local function csv(s)
  local out = {}
  if s then
    for item in string.gmatch(s, '[^,]+') do out[#out + 1] = item end
  end
  return out
end

local function contains(list, value)
  for _, v in ipairs(list) do
    if v == value then return true end
  end
  return false
end

local function is_live(state)
  return state == 'pending' or state == 'running'
end

local function stage_terminal(status)
  return status == 'done' or status == 'failed' or status == 'aborted'
end

local function submit_stage(wf, prefix, id, stage, attempt, now)
  redis.call('HSET', wf .. ':stages', stage, 'pending', stage .. ':attempt', attempt, stage .. ':t_submit', now)
  redis.call('XADD', prefix .. ':stage:' .. stage .. ':tasks', '*', 'wf', id, 's', stage, 'a', attempt)
end

-- Move a workflow to a terminal state, once. Callers checked it was live.
-- Partial outputs stay (labelled by stage); edge logs go; the rest expires.
local function finalize(wf, inflight_key, prefix, id, state, err, err_stage, now, tomb_ttl, result_ttl)
  local sk = wf .. ':stages'
  local rec = redis.call('HMGET', wf, 'stages', 'edges', 'finals', 'webhook')
  redis.call('HSET', wf, 'state', state, 'finished_ms', now, 'updated_ms', now)
  if err and err ~= '' then
    redis.call('HSET', wf, 'error', err, 'error_stage', err_stage or '')
  end
  if state ~= 'completed' then
    for _, stage in ipairs(csv(rec[1])) do
      local st = redis.call('HGET', sk, stage)
      if not stage_terminal(st) then
        if stage == err_stage and state == 'failed' then
          redis.call('HSET', sk, stage, 'failed', stage .. ':t_end', now)
        else
          redis.call('HSET', sk, stage, 'aborted', stage .. ':t_end', now)
        end
      end
    end
    redis.call('SET', prefix .. ':tomb:' .. id, state, 'EX', tomb_ttl)
    redis.call('PUBLISH', prefix .. ':abort', id)
  end
  redis.call('ZREM', inflight_key, id)
  for _, edge in ipairs(csv(rec[2])) do
    redis.call('UNLINK', wf .. ':edge:' .. edge)
  end
  redis.call('XADD', wf .. ':log', '*', 't', 'terminal', 'state', state, 'error', err or '', 'stage', err_stage or '')
  redis.call('EXPIRE', wf, result_ttl)
  redis.call('EXPIRE', sk, result_ttl)
  redis.call('EXPIRE', wf .. ':log', result_ttl)
  for _, stage in ipairs(csv(rec[3])) do
    redis.call('EXPIRE', wf .. ':out:' .. stage, result_ttl)
  end
  if rec[4] and rec[4] ~= '' then
    redis.call('XADD', prefix .. ':notify', '*', 'wf', id, 'state', state)
  end
end

-- Append one entry to the edge log <src> -> <dst> and, when a session of <dst> is already
-- bound to a worker, queue a copy for that worker's inbox (`<prefix>:inbox:<replica>`):
-- a worker reads one stream for all its sessions' inputs. Entries written before the
-- claim are in the edge log, which claim.lua returns (catch-up); after it, in the inbox.
-- The copies of one script call go out as one inbox entry per consumer (`flush_forwards`).
local forwards = {}        -- dst -> {inbox key, dst attempt, src, entries, id, dst} (or false: not bound)
local forward_order = {}

local function edge_append(wf, prefix, id, src, dst, fields)
  redis.call('XADD', wf .. ':edge:' .. src .. ':' .. dst, '*', unpack(fields))
  local fwd = forwards[dst]
  if fwd == nil then
    local cur = redis.call('HMGET', wf .. ':stages', dst, dst .. ':replica', dst .. ':attempt')
    if (cur[1] == 'waiting_input' or cur[1] == 'running') and cur[2] then
      fwd = {prefix .. ':inbox:' .. cur[2], cur[3], src, {}, id, dst}
    else
      fwd = false
    end
    forwards[dst] = fwd
    forward_order[#forward_order + 1] = dst
  end
  if fwd then
    local entries = fwd[4]
    entries[#entries + 1] = fields
  end
end

local function flush_forwards()
  for _, dst in ipairs(forward_order) do
    local fwd = forwards[dst]
    if fwd and #fwd[4] > 0 then
      redis.call('XADD', fwd[1], '*', 'wf', fwd[5], 'ds', fwd[6], 'da', fwd[2], 'src', fwd[3], 'm', cmsgpack.pack(fwd[4]))
    end
  end
  forwards, forward_order = {}, {}
end

-- Close one session (outcome 'done' or 'failed') and report it to the reconciler.
-- The task is acked first, always: a fenced session must not be redelivered.
-- Returns 'ok' | 'fenced'.
local function finish_session(wf, prefix, tasks_key, events_key, group, entry_id, stage, attempt, outcome,
                              detail, retryable, now, seq, downstream)
  local sk = wf .. ':stages'
  redis.call('XACK', tasks_key, group, entry_id)
  redis.call('XDEL', tasks_key, entry_id)
  local rec = redis.call('HMGET', wf, 'state', 'id')
  local cur = redis.call('HMGET', sk, stage, stage .. ':attempt')
  if not is_live(rec[1]) or tostring(cur[2]) ~= tostring(attempt) then return 'fenced' end
  if cur[1] ~= 'running' and cur[1] ~= 'waiting_input' then return 'fenced' end
  if outcome == 'done' then
    for _, dst in ipairs(csv(downstream)) do
      edge_append(wf, prefix, rec[2], stage, dst, {'eos', '1', 'seq', seq, 'a', attempt})
    end
    redis.call('HSET', sk, stage, 'done', stage .. ':t_end', now, stage .. ':usage', detail)
  else
    redis.call('HSET', sk, stage, 'failed', stage .. ':t_end', now, stage .. ':error', detail)
  end
  redis.call('XADD', wf .. ':log', '*', 't', 'stage', 'stage', stage, 'status', outcome, 'attempt', attempt)
  redis.call('XADD', events_key, '*', 't', outcome, 'wf', rec[2], 's', stage, 'a', attempt, 'd', detail,
    'r', retryable)
  return 'ok'
end
