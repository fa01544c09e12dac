-- emit: write a session's output steps (fenced; idempotent on seq), optionally then finish it.
-- KEYS[1] wf base key  KEYS[2] the stage's task stream  KEYS[3] events stream (2 and 3: finish only;
-- both of the workflow's cell)  KEYS[4] log  KEYS[5] out:<stage>  KEYS[6] blobs; then edge:<stage>:<dst>
-- of each downstream stage, `<wf>:stages` for a workflow of before (see stages_known in _lib.lua;
-- a call for one that does not declare it is refused, nothing written), the inbox of each replica
-- the caller knows to consume one of them (see unbound_inbox in _lib.lua), the finish's usage key
-- (if metered), and last the payload keys of this call's 'B' ops, one per op, in order
-- (omniflow.storage.transitions.emit)
-- Ops never name a key by a suffix: 'X' and 'A' name KEYS[4] or KEYS[5] by position, 'B' one of
-- the payload keys at the end of KEYS.
-- ARGV[1] stage  ARGV[2] attempt  ARGV[3] new stage status or ''  ARGV[4] now_ms  ARGV[5] workflow id
-- ARGV[6] msgpack array of steps; a step is {seq, op, ...} with ops applied in order:
--   'X', key position, {f1, v1, ..., fn, vn} XADD KEYS[position] * fields (the log or the output)
--   'E', downstream stage, {fields}           append to the edge log (+ forward to the consumer's inbox);
--                                             all of one call's chunks for one edge form ONE edge entry
--   'P', downstream stage, packed             the same, the chunk's {fields} already msgpack-packed by
--                                             the caller (what a worker sends: the script neither
--                                             decodes nor packs it again; its consumer checks it)
--   'T', text, ''                             a final text delta: the call's deltas are appended to
--                                             the stage's `<stage>:text` field (a record with `ko`:
--                                             read and written with the call's other stage fields), or
--                                             APPENDed to <wf>:out:<stage> (a record of before), and
--                                             logged as ONE `text` entry
--                                             {stage, from = first, seq = last step with text, delta = all}
--   'A', key position, value                  APPEND KEYS[position] value (the log or the output)
--   'H', field, value                         HSET stages field value
--   'I', field, increment                     HINCRBY stages field increment
--   'C', checkpoint, ''                       append to the stage's resume checkpoint (`<stage>:ckpt` in
--                                             the stages hash; the call's pieces in one HSET)
--   'B', key position, {payload, ttl_ms}      SET KEYS[position] payload PX ttl_ms and list it in blobs
--                                             (a chunk payload an 'E' op of the step references; stored
--                                             with the entry, fenced and skipped on replay like it)
--   Steps whose seq is not above the stage's last written seq are skipped (replays).
--   Steps must be contiguous: one past a hole (a write lost with a Redis connection) is refused.
-- ARGV[7] optional msgpack finish: {group, entry id, outcome, detail, retryable, last seq, downstream csv
--   [, meter: {usage key, its expiry epoch s, compute ms, prompt tokens, completion tokens} or false
--   [, completion: {inflight set, result ttl s[, the workflow's stages csv (read with the record)]}]]}
--   (see finish.lua and finish_session in _lib.lua), applied after the steps; the meter's usage key is
--   one of KEYS (after the edges). With a completion (the session of a final stage no other final
--   stage follows, `Keys.finalize_keys` and the inflight set declared after the meter's key), a done
--   that completes the workflow's terminal set ends the workflow here ('completed'), instead of in
--   the reconciler's `stage_event.lua` one hop later.
-- ARGV[8] optional: the calling replica (worker id), when it hands the chunks this call writes for its
--   own sessions to them in memory: a consumer bound to it gets no inbox copy (`SELF` in _lib.lua);
--   ARGV[7] is '' when there is no finish
-- Returns 'ok' | 'completed' (with a finish: the workflow completed in this call) | 'dup' (every step was already written) | 'fenced' (session no longer owns the stage)
--       ('ok' and 'completed' as {code, dst, dst attempt, ...} when the call wrote to edges whose consumer is
--        bound to the caller, ARGV[8]: those got no inbox copy, the caller hands them the call's chunks)
--       | 'gap' (steps after a hole were not written: the attempt must end; a retry resumes)
--       | {'inbox', dst, replica} (nothing written: stage dst is bound to replica, whose inbox is not in
--         KEYS; send the call again declaring it. dst and replica are '' for a call sent after such a
--         refused one and before it was sent again: send it again after that one)
--       | an error reply, with nothing written, when the steps or the finish are malformed
--         (Redis never rolls back a script that fails part-way: everything is checked first)
--@include _lib.lua
local wf, stage = KEYS[1], ARGV[1]
local INBOX_WAIT_MS = 5000      -- how long calls wait for an earlier refused one (`<stage>:inbox_wait`)
local sk = nil                  -- where the stage fields are (read_all: read_record)
local log_key, out_key, blobs_key = KEYS[4], KEYS[5], KEYS[6]
local blobs_flagged = false

-- nil when every step is well-formed, else what is wrong
local function check_steps(steps)
  if type(steps) ~= 'table' then return 'steps are not an array' end
  local payload_at = {}        -- the payload key positions 'B' ops name, checked once they are counted
  for n = 1, #steps do
    local step = steps[n]
    local seq = type(step) == 'table' and tonumber(step[1])
    if not seq then return 'step ' .. n .. ' has no seq' end
    step[1] = seq                -- (a number from here on: the loops below read it as it is)
    local i = 2
    while i <= #step do
      local op, a, b = step[i], step[i + 1], step[i + 2]
      if op == 'X' or op == 'A' then
        if (a ~= 4 and a ~= 5) or KEYS[a] == nil then
          return 'step ' .. n .. ': op ' .. op .. ' names neither the log nor the output'
        end
      elseif op == 'B' then
        if type(a) ~= 'number' then return 'step ' .. n .. ': op B names no payload key' end
        payload_at[#payload_at + 1] = n
        payload_at[#payload_at + 1] = a
      elseif type(a) ~= 'string' then return 'step ' .. n .. ': op ' .. tostring(op) .. ' needs a name' end
      if op == 'X' or op == 'E' then
        if type(b) ~= 'table' or #b == 0 or #b % 2 ~= 0 then return 'step ' .. n .. ': op ' .. op .. ' needs field pairs' end
        for j = 1, #b do
          local t = type(b[j])
          if t ~= 'string' and t ~= 'number' then return 'step ' .. n .. ': op ' .. op .. ' has a bad field' end
        end
      elseif op == 'P' then
        if type(b) ~= 'string' or b == '' then return 'step ' .. n .. ': op P needs a packed chunk' end
      elseif op == 'I' then
        if tonumber(b) == nil then return 'step ' .. n .. ': op I needs a number' end
      elseif op == 'B' then
        if type(b) ~= 'table' or type(b[1]) ~= 'string' or tonumber(b[2]) == nil or tonumber(b[2]) <= 0 then
          return 'step ' .. n .. ': op B needs {payload, ttl_ms}'
        end
      elseif op == 'T' or op == 'A' or op == 'H' or op == 'C' then
        local tb = type(b)
        if tb ~= 'string' and tb ~= 'number' then return 'step ' .. n .. ': op ' .. op .. ' needs a value' end
      else
        return 'step ' .. n .. ': unknown op ' .. tostring(op)
      end
      i = i + 3
    end
  end
  local payloads = #payload_at / 2     -- the payload keys are the last KEYS, one per 'B' op
  if payloads > 0 then
    local first_payload = #KEYS - payloads + 1
    if first_payload <= 6 then return 'payload keys missing from KEYS' end
    for k = 1, #payload_at, 2 do
      local a = payload_at[k + 1]
      if a < first_payload or a > #KEYS then return 'step ' .. payload_at[k] .. ': op B names no payload key' end
    end
  end
  return nil
end

local decoded, steps = pcall(cmsgpack.unpack, ARGV[6])
local bad = (not decoded and 'steps do not decode') or check_steps(steps)
local fin = nil
if ARGV[8] and ARGV[8] ~= '' then SELF = ARGV[8] end
if not bad and ARGV[7] and ARGV[7] ~= '' then
  local ok
  ok, fin = pcall(cmsgpack.unpack, ARGV[7])
  if not ok or not valid_finish(fin) then bad = 'the finish is malformed' end
end
if bad then return redis.error_reply('emit: ' .. bad .. ' (nothing written)') end

-- One read of the record (the finish's fields too) with the stage fields: this stage's, each
-- consumer's (`consumer_of`), those the steps' 'I' and 'C' ops change (`read_record`). The stage's
-- writes are gathered in SW and join the call's buffered writes (`hset`) once the steps are written,
-- before the finish's: one HSET per hash at `hflush` (the last write of a field wins, as it would one
-- HSET after another).
local rec = nil               -- the record's fields read (FINISH_REC's with a finish)
local SW = {}                 -- field, value, ... to write to the stage hash
local ival = {}               -- the current values of the fields 'I' ops change
local fin_cur = nil           -- the finish's view of this stage (finish_session's `cur`)

local function read_all()
  local rf = {'state'}
  if fin then rf = fin[9] and FINISH_FINAL_REC or FINISH_REC end     -- (FINAL: what finalize reads)
  -- a field that is not there costs a whole scan of a small hash: only what this call needs
  local fields = {stage, stage .. ':attempt', stage .. ':seq', stage .. ':inbox_wait'}
  if fin then
    fields[5] = stage .. ':samples'
    fields[6] = stage .. ':sr'
  end
  local dsts, at, iat = {}, {}, {}
  local ckpt_at, text_at = nil, nil
  local function want_dst(dst)
    if not at[dst] then
      at[dst] = #fields + 1
      dsts[#dsts + 1] = dst
      fields[#fields + 1] = dst
      fields[#fields + 1] = dst .. ':replica'
      fields[#fields + 1] = dst .. ':attempt'
    end
  end
  for k = 1, #steps do
    local step = steps[k]
    for i = 2, #step, 3 do
      if step[i] == 'E' or step[i] == 'P' then
        want_dst(step[i + 1])
      elseif step[i] == 'I' and not iat[step[i + 1]] then
        iat[step[i + 1]] = #fields + 1
        fields[#fields + 1] = step[i + 1]
      elseif step[i] == 'C' and not ckpt_at then
        ckpt_at = #fields + 1
        fields[#fields + 1] = stage .. ':ckpt'
      elseif step[i] == 'T' and not text_at then
        -- the text so far, and `ko` (a record field: in the stage fields' hash only where they are
        -- in the record, so a workflow of before has none and APPENDs to its out key)
        text_at = #fields + 1
        fields[#fields + 1] = stage .. ':text'
        fields[#fields + 1] = 'ko'
      end
    end
  end
  if fin and fin[3] == 'done' then
    local down = csv_ro(fin[7])
    for j = 1, #down do want_dst(down[j]) end
  end
  -- a finish that may complete the workflow: every stage's attempt too (the terminal set's check,
  -- `terminal_set_complete`), where the caller named its workflow's stages (the completion's 3rd item)
  if fin and fin[9] and fin[9][3] then
    local all_stages = csv_ro(fin[9][3])
    for j = 1, #all_stages do fields[#fields + 1] = all_stages[j] .. ':attempt' end
  end
  local v, all, got
  rec, sk, v, all, got = read_record(wf, rf, fields)
  if fin and fin[9] then hseed(wf, all, got) end
  for k = 1, #dsts do
    local dst = dsts[k]
    local j = at[dst]
    bound[dst] = {v[j], v[j + 1], v[j + 2]}
  end
  for f, j in pairs(iat) do ival[f] = v[j] end
  return rec[1], v, ckpt_at and v[ckpt_at], text_at and v[text_at + 1] and (v[text_at] or '')
end

local function write_steps()
  local state, cur, ckpt_prev, text_prev = read_all()     -- text_prev: nil where text goes to out:<stage>
  if state ~= 'running' then return 'fenced' end
  if not sk then return false end     -- a workflow of before, `<wf>:stages` not declared
  if cur[2] ~= ARGV[2] then return 'fenced' end
  if cur[1] ~= 'running' and cur[1] ~= 'waiting_input' then return 'fenced' end
  local last = tonumber(cur[3] or '0')
  -- every consumer this call forwards to must have its inbox declared: else nothing is written
  local dsts, seen, first = {}, {}, nil
  local upto = 0          -- the last step's seq of this call (see below)
  for k = 1, #steps do
    local step = steps[k]
    local seq = step[1]
    if seq > upto then upto = seq end
    if seq > last then
      first = first or seq
      for i = 2, #step, 3 do
        if (step[i] == 'E' or step[i] == 'P') and not seen[step[i + 1]] then
          seen[step[i + 1]] = true
          dsts[#dsts + 1] = step[i + 1]
        end
      end
    end
  end
  if fin and fin[3] == 'done' then
    local down = csv_ro(fin[7])
    for k = 1, #down do
      if not seen[down[k]] then dsts[#dsts + 1] = down[k] end
    end
  end
  -- `<stage>:inbox_wait` = '<attempt>:<seq>:<ms>': calls of this attempt were refused (for an inbox,
  -- or to wait their turn) with steps up to <seq>, the last at <ms>; they are being sent again, in any
  -- order. Until every one of them is written, a call whose steps do not follow what is stored waits
  -- its turn too (it is not a hole: the steps before it are on their way), and so does a finish. A
  -- refused call is sent again within milliseconds; one that never is (its sending failed: the
  -- attempt is ending) must not hold the attempt's other calls, its closing finish among them, for
  -- ever: past INBOX_WAIT_MS nothing waits for it any more (a step after it is a hole, a finish over
  -- it closes the attempt as failed, and the retry resumes).
  local wa, wseq, wms = string.match(cur[4] or '', '^(%d+):(%d+):(%d+)$')
  local waiting = wa == ARGV[2] and tonumber(ARGV[4]) - tonumber(wms) <= INBOX_WAIT_MS
  wseq = waiting and tonumber(wseq) or 0
  -- refused for an inbox (dst, replica), or ('', '') to wait its turn; a call waiting its turn
  -- keeps the marker's time: the wait lapses INBOX_WAIT_MS after the last refusal for an inbox,
  -- however often the waiting calls are sent again (a finish retried every few seconds behind a
  -- call that was never sent again would otherwise wait for ever)
  local function refuse(dst, replica)
    local ms = ARGV[4]
    if dst == '' then ms = wms end       -- only ever while waiting
    redis.call('HSET', sk, stage .. ':inbox_wait', ARGV[2] .. ':' .. math.max(upto, wseq) .. ':' .. ms)
    return {'inbox', dst, replica}
  end
  local unbound = unbound_inbox(wf, dsts)
  if unbound then return refuse(unbound[1], unbound[2]) end
  local status = cur[1]
  if waiting then
    -- a call refused earlier has not been written yet: one sent after it waits its turn
    if first == nil then
      if fin and last < wseq then return refuse('', '') end
    elseif first > last + 1 then
      return refuse('', '')
    end
    local stored = math.max(last, upto)
    if stored >= wseq then redis.call('HDEL', sk, stage .. ':inbox_wait') end
  elseif cur[4] then
    redis.call('HDEL', sk, stage .. ':inbox_wait')      -- an earlier attempt's
  end
  if ARGV[3] ~= '' and cur[1] ~= ARGV[3] then
    status = ARGV[3]
    SW[#SW + 1] = stage
    SW[#SW + 1] = status
    log_event(log_key, {'t', 'stage', 'stage', stage, 'status', ARGV[3], 'attempt', ARGV[2]})
  end
  local texts, tfirst, tlast = {}, nil, nil
  local ckpts = {}
  local wrote = 0
  local gap = false
  for k = 1, #steps do
    local step = steps[k]
    local seq = step[1]
    if seq > last + 1 then
      gap = true
      break
    end
    if seq > last then
      local i = 2
      while i <= #step do
        local op = step[i]
        if op == 'X' then
          if step[i + 1] == 4 then log_event(log_key, step[i + 2])     -- (the log: one entry per call)
          else redis.call('XADD', KEYS[step[i + 1]], '*', unpack(step[i + 2])) end
        elseif op == 'E' or op == 'P' then
          edge_append(wf, ARGV[5], stage, step[i + 1], step[i + 2])
        elseif op == 'T' then
          texts[#texts + 1] = step[i + 1]
          tfirst, tlast = tfirst or seq, seq
        elseif op == 'A' then
          redis.call('APPEND', KEYS[step[i + 1]], step[i + 2])
        elseif op == 'H' then
          SW[#SW + 1] = step[i + 1]
          SW[#SW + 1] = step[i + 2]
          if ival[step[i + 1]] ~= nil then ival[step[i + 1]] = step[i + 2] end
        elseif op == 'I' then       -- HINCRBY's arithmetic, on the value read up front
          local f = step[i + 1]
          local n, by = tonumber(ival[f] or '0'), tonumber(step[i + 2])
          if n == nil or by == nil or n ~= math.floor(n) or by ~= math.floor(by) then
            error('ERR hash value is not an integer (' .. f .. ')')
          end
          ival[f] = string.format('%d', n + by)
          SW[#SW + 1] = f
          SW[#SW + 1] = ival[f]
        elseif op == 'C' then
          ckpts[#ckpts + 1] = step[i + 1]
        elseif op == 'B' then
          local blob, ttl = KEYS[step[i + 1]], step[i + 2][2]
          redis.call('SET', blob, step[i + 2][1], 'PX', ttl)
          if redis.call('SADD', blobs_key, blob) == 1 and not blobs_flagged then
            redis.call('HSET', wf, 'blobs', '1')     -- finalize frees them (read with the record)
            blobs_flagged = true
          end
          redis.call('PEXPIRE', blobs_key, ttl)
        end
        i = i + 3
      end
      last = seq
      wrote = wrote + 1
    end
  end
  if #texts > 0 then
    local delta = table.concat(texts)
    if text_prev then
      SW[#SW + 1] = stage .. ':text'
      SW[#SW + 1] = text_prev .. delta
    else
      redis.call('APPEND', out_key, delta)
    end
    log_event(log_key, {'t', 'text', 'stage', stage, 'from', tfirst, 'seq', tlast, 'delta', delta})
  end
  if #ckpts > 0 then
    SW[#SW + 1] = stage .. ':ckpt'
    SW[#SW + 1] = (ckpt_prev or '') .. table.concat(ckpts)
  end
  if wrote > 0 then
    SW[#SW + 1] = stage .. ':seq'
    SW[#SW + 1] = last
  end
  -- what finish_session reads of this stage: status, attempt, seq, samples, sr as written here
  fin_cur = {status, cur[2], last, ival[stage .. ':samples'] or cur[5], cur[6]}
  for j = 1, #SW - 1, 2 do
    if SW[j] == stage .. ':sr' then fin_cur[5] = SW[j + 1] end
  end
  if gap then return 'gap' end
  if wrote == 0 and #steps > 0 then
    return 'dup'
  end
  return 'ok'
end

local function flush_stage()
  if #SW > 0 then hset_list(sk, SW) end
end

local res = write_steps()
if type(res) == 'table' then return res end       -- refused for an inbox: nothing written
if res == false then
  return redis.error_reply('emit: workflow ' .. ARGV[5] .. ' is of the storage layout before (its stage fields ' ..
    'in ' .. wf .. ':stages), which this call did not declare (nothing written)')
end
flush_stage()
-- the code, with the consumers bound to the caller that this call wrote to (see LOCAL in _lib.lua)
local function answer(code)
  if #LOCAL == 0 then return code end
  return {code, unpack(LOCAL)}
end
if not fin then
  flush_edges()
  hflush()
  flush_log()
  return answer(res)
end
do
  local f = fin
  local outcome, detail, retryable = f[3], f[4], f[5]
  if res == 'gap' then      -- never close as done over a hole: fail the attempt, the retry resumes
    outcome, detail, retryable = 'failed', 'an earlier write of this attempt was lost', '1'
  end
  local pre = nil
  if fin_cur then pre = {rec = rec, cur = fin_cur, z = f[9]} end
  local closed = finish_session(wf, KEYS[2], KEYS[3], f[1], f[2], stage, ARGV[2], outcome, detail,
    retryable, ARGV[4], f[6], f[7], f[8] or nil, pre)
  flush_edges()
  if res ~= 'fenced' and res ~= 'gap' and pre and pre.completing then
    -- the terminal set is complete: the workflow ends here (finalize writes what is buffered)
    hset(wf, 'finished', pre.completing, 'updated_ms', ARGV[4])
    finalize(wf, pre.z[1], '', rec[2], 'completed', nil, nil, ARGV[4], 0, pre.z[2])
    flush_log()
    return answer('completed')
  end
  hflush()
  flush_log()
  if res == 'fenced' or res == 'gap' then return res end
  if closed ~= 'ok' then return closed end
  return answer('ok')
end
