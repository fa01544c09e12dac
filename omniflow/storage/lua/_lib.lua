-- Shared helpers, spliced into scripts that say `--@include _lib.lua`.
-- Every key a script touches is one of its KEYS, and all of them are keys of one cell
-- (`<prefix>:{<cell tag>}:...`, omniflow/storage/keys.py): one cluster slot. Scripts build key
-- names from the workflow's base key (`<cell>:wf:<id>`) or the cell's base, and pass each through
-- `key()`, which refuses (an error naming it) a key the caller did not declare. A consuming
-- worker's inbox is declared like every other key; a call that would forward to one it did not
-- declare writes nothing and says which (`unbound_inbox`). The one key a script touches without
-- declaring it: the payload keys `finalize` unlinks (see there).

local DECLARED = {}
for i = 1, #KEYS do DECLARED[KEYS[i]] = true end

local function key(name)
  if not DECLARED[name] then error('undeclared key ' .. name .. ' (pass it in KEYS)') end
  return name
end

-- `<prefix>:{<tag>}` of any key of a cell (the last key asked about and its answer kept: a call asks
-- about its workflow's key again and again, and a pattern match is ~1,400 instructions of this Lua)
local CELL_OF, CELL_BASE = nil, nil
local function cell_base(k)
  if k ~= CELL_OF then CELL_OF, CELL_BASE = k, string.match(k, '^(.-%b{})') end
  return CELL_BASE
end

-- (The helpers on every call's path loop with numeric `for`s: an `ipairs` step is a C call in this
-- Lua, twice the time; bench/notes.md, round 9.)
local function csv(s)
  if not s or s == '' then return {} end
  if not string.find(s, ',', 1, true) then return {s} end      -- one item (most lists): half the work
  local out, n, i, len = {}, 0, 1, #s
  while i <= len do
    local j = string.find(s, ',', i, true) or len + 1
    if j > i then
      n = n + 1
      out[n] = string.sub(s, i, j - 1)
    end
    i = j + 1
  end
  return out
end

-- `csv`, parsed once per call (the same record field is read by several helpers on a call's path:
-- the finals, the edges, the stages): the list is shared, so only a caller that never changes it
-- uses this one
local CSV = {}
local function csv_ro(s)
  if not s then return {} end
  local out = CSV[s]
  if out == nil then
    out = csv(s)
    CSV[s] = out
  end
  return out
end

local function contains(list, value)
  for i = 1, #list do
    if list[i] == value then return true end
  end
  return false
end

-- The list kept under `k` in `map` (a new one, its key appended to `keys`, the first time): what a
-- call gathers per key and then writes key by key, in the order the keys first came.
local function list_in(map, keys, k)
  local list = map[k]
  if list == nil then
    list = {}
    map[k] = list
    keys[#keys + 1] = k
  end
  return list
end

local function is_live(state)
  return state == 'pending' or state == 'running'
end

local function stage_terminal(status)
  return status == 'done' or status == 'failed' or status == 'aborted'
end

-- One read and one write per hash and script call: `hread` reads the fields it is given that the call
-- has not read yet (one HMGET), `hget` answers from what was read or written, `hset`/`hdel` buffer
-- the call's writes, and `hflush` writes each hash's buffered fields with one HSET (and one HDEL).
-- A script that buffers writes calls `hflush` before it returns; nothing reads such a hash with
-- redis.call between (every read in these helpers goes through `hget`).
local HV, HW, HW_KEYS = {}, {}, {}

local function hread(k, fields)
  local known = HV[k]
  if known == nil then
    known = {}
    HV[k] = known
  end
  local pend = HW[k]
  local want, seen, n = nil, nil, 0      -- (no garbage when every field is known: the common case)
  for i = 1, #fields do
    local f = fields[i]
    if known[f] == nil and not (pend and pend.v[f] ~= nil) and not (seen and seen[f]) then
      if want == nil then want, seen = {}, {} end
      seen[f] = true
      n = n + 1
      want[n] = f
    end
  end
  if want then
    local got = redis.call('HMGET', k, unpack(want))
    for i = 1, n do known[want[i]] = got[i] end       -- false: no such field
  end
end

local function hget(k, f)
  local pend = HW[k]
  if pend then
    local v = pend.v[f]
    if v ~= nil then return v or nil end
  end
  local known = HV[k]
  if known == nil or known[f] == nil then
    hread(k, {f})
    known = HV[k]
  end
  return known[f] or nil
end

-- (up to four fields as arguments: a vararg function builds a table of its arguments on every call,
-- ~2,300 instructions of this Lua, more than the rest of hset; `hset_list` for more)
local function hset(k, f1, v1, f2, v2, f3, v3, f4, v4, more)
  if more ~= nil then error('hset: at most four fields (hset_list)') end
  local pend = HW[k]
  if pend == nil then
    pend = {v = {}, order = {}}
    HW[k] = pend
    HW_KEYS[#HW_KEYS + 1] = k
  end
  local v, order = pend.v, pend.order
  if v[f1] == nil then order[#order + 1] = f1 end
  v[f1] = v1
  if f2 == nil then return end
  if v[f2] == nil then order[#order + 1] = f2 end
  v[f2] = v2
  if f3 == nil then return end
  if v[f3] == nil then order[#order + 1] = f3 end
  v[f3] = v3
  if f4 == nil then return end
  if v[f4] == nil then order[#order + 1] = f4 end
  v[f4] = v4
end

-- `hset` of the fields and values of list `a` ({f1, v1, ..., fn, vn})
local function hset_list(k, a)
  for i = 1, #a - 1, 2 do hset(k, a[i], a[i + 1]) end
end

local function hdel(k, f) hset(k, f, false) end

-- Fields of hash `k` the caller read already with a HMGET of its own (`names[i]` -> `values[i]`,
-- false: no such field): later `hread`s of them issue no command.
local function hseed(k, names, values)
  local known = HV[k]
  if known == nil then
    known = {}
    HV[k] = known
  end
  for i = 1, #names do
    local f = names[i]
    if known[f] == nil then known[f] = values[i] end
  end
end

local function hflush()
  for h = 1, #HW_KEYS do
    local k = HW_KEYS[h]
    local pend, known = HW[k], HV[k] or {}
    HV[k] = known
    local sets, dels, ns = {}, {}, 0
    local order, pv = pend.order, pend.v
    for i = 1, #order do
      local f = order[i]
      local v = pv[f]
      if v == false then dels[#dels + 1] = f else
        sets[ns + 1] = f
        sets[ns + 2] = v
        ns = ns + 2
      end
      known[f] = v
    end
    if #sets > 0 then redis.call('HSET', k, unpack(sets)) end
    if #dels > 0 then redis.call('HDEL', k, unpack(dels)) end
  end
  HW, HW_KEYS = {}, {}
end

-- Listing indexes: `<cell>:idx:state:<state>`, one zset per workflow state in each cell (member
-- id, score creation ms), kept exact by the transitions that change a workflow's state: the first
-- claim (-> running) and finalize (they declare the cell's state indexes they touch).
-- `pending` has no index of its own: the pending workflows are the cell's `inflight` set less
-- the running index (`omniflow.storage.listing`), so a workflow's start costs one ZADD, not a
-- ZREM and a ZADD. `omniflow.listing` reads them.
local function index_state(wf, id, from, to, created)
  local cell = cell_base(wf)
  if from == 'running' then redis.call('ZREM', key(cell .. ':idx:state:running'), id) end
  redis.call('ZADD', key(cell .. ':idx:state:' .. to), created, id)
end

-- `<prefix>:notify` keeps at most about this many entries (`omniflow jobs` reads and deletes them)
local NOTIFY_MAX_LEN = 100000
-- `<cell>:ends` (every workflow as it ends: what a watcher of many reads, omniflow.client.bulk) keeps
-- about the last this many: a watcher that falls further behind finds its workflows' ends at its
-- periodic check instead
local ENDS_MAX_LEN = 10000

-- A stage's task stream is its queue in the workflow's pipeline version and priority class:
-- `<c>:stage:<stage>@<version>:tasks` for the `api` class, `...:tasks:<class>` for the others
-- (omniflow/pipeline.py `Pipeline.queue`, `Keys.tasks`), so a session waits for a worker that serves that
-- version, in its class. Its name is data (the record's `pipeline_hash` and `prio`): built from the
-- cell's base, it is in this script's slot; callers that know the version declare it (every class's
-- stream: `Keys.task_streams`), the others (a retry, a successor submitted by the reconciler) need not.
-- A record without a version (made by hand) uses the stage's name; one without a class, `api`.
-- `version`: the record's `pipeline_hash` when the caller has read it already (nil: read here).
-- The class is read once per workflow and call (PRIO; submit sets it from its fields).
local PRIO = {}
local function tasks_key(wf, stage, version)
  if version == nil then version = hget(wf, 'pipeline_hash') end
  local prio = PRIO[wf]
  if prio == nil then
    prio = hget(wf, 'prio') or 'api'
    PRIO[wf] = prio
  end
  local base = cell_base(wf) .. ':stage:' .. stage .. ':tasks'
  if version and version ~= '' then
    base = cell_base(wf) .. ':stage:' .. stage .. '@' .. version .. ':tasks'
  end
  if prio == 'api' or prio == '' then return base end
  return base .. ':' .. prio
end

-- Where a workflow's stage fields are (`<stage>`, `<stage>:attempt`, ...: omniflow.storage.schema
-- .StageField): in its record, beside the workflow's own fields (`sl` = '1', set by submit: one hash,
-- so a call reads and writes both with one HMGET and one HSET), or, for a workflow an omniflow of
-- before submitted (a record without `sl`), in `<wf>:stages`: such a workflow ends where it started.
-- The reconciler's and the client's calls always declare that key; a worker's claim and emit
-- declare it only for a workflow claimed as one (claim answers 'layout' for it, and the worker
-- claims it again declaring the key: omniflow.engine.worker.claims). `false`: the record is of
-- before and its `<wf>:stages` is not declared (a call that meets this writes nothing). A record
-- that is not there (`state`: nil) has no stage fields anywhere: its own key stands for them.
-- `stages_known`: the caller read the record's `sl` and `state` itself (with its own HMGET);
-- `stages_of` reads them with the record (`hget`: free when the caller's `hread` had them).
local SKEY = {}
local function stages_known(wf, sl, state)
  local sk = wf
  if sl ~= '1' and state then
    sk = wf .. ':stages'
    if not DECLARED[sk] then sk = false end
  end
  SKEY[wf] = sk
  return sk
end

local function stages_of(wf)
  local sk = SKEY[wf]
  if sk == nil then sk = stages_known(wf, hget(wf, 'sl'), hget(wf, 'state')) end
  if sk == false then error('undeclared key ' .. wf .. ':stages (a workflow of before: pass it in KEYS)') end
  return sk
end

-- The record's fields `rf` (the first is 'state') and the stage fields `sf` of workflow `wf` with one
-- HMGET (a second one, of `<wf>:stages`, for a workflow of before): {the values of rf}, the key the
-- stage fields are in (`false`, and no stage fields read: a workflow of before whose `<wf>:stages`
-- the caller did not declare, see stages_known), {the values of sf}; and the fields the HMGET asked
-- and what it answered (for `hseed`).
local function read_record(wf, rf, sf)
  local all, nr, ns = {}, #rf, #sf
  for i = 1, nr do all[i] = rf[i] end
  nr = nr + 1
  all[nr] = 'sl'
  for i = 1, ns do all[nr + i] = sf[i] end
  local got = redis.call('HMGET', wf, unpack(all))
  local rec, cur = {}, {}
  for i = 1, nr - 1 do rec[i] = got[i] end
  local sk = stages_known(wf, got[nr], got[1])
  if sk == wf then
    for i = 1, ns do cur[i] = got[nr + i] end
  elseif sk then
    cur = redis.call('HMGET', sk, unpack(sf))
  end
  return rec, sk, cur, all, got
end

-- A workflow's event log gets at most ONE entry per script call: `log_event` gathers the call's
-- events (flat field lists, the first field pair `t`, <kind>), `flush_log` writes them, in order. The
-- entry's fields are the first event's; with more than one, field `more` holds the msgpack array of
-- the others (each a flat field list). Readers expand an entry into its events
-- (omniflow.storage.schema.log_events: the k-th further one's id is `<entry id>.<k>`). Every script
-- that logs calls `flush_log` before it returns.
local LOGS, LOG_KEYS = {}, {}
local function log_event(log, fields)
  local evs = list_in(LOGS, LOG_KEYS, log)
  evs[#evs + 1] = fields
end

local function flush_log()
  for i = 1, #LOG_KEYS do
    local log = LOG_KEYS[i]
    local evs = LOGS[log]
    if #evs == 1 then
      redis.call('XADD', log, '*', unpack(evs[1]))
    else
      local first, more = evs[1], {}
      for j = 2, #evs do more[j - 1] = evs[j] end
      local n = #first
      first[n + 1], first[n + 2] = 'more', cmsgpack.pack(more)
      redis.call('XADD', log, '*', unpack(first))
    end
  end
  LOGS, LOG_KEYS = {}, {}
end

local function submit_stage(wf, id, stage, attempt, now, version)
  local sk = stages_of(wf)
  redis.call('HSET', sk, stage, 'pending', stage .. ':attempt', attempt, stage .. ':t_submit', now)
  local known = HV[sk]
  if known then known[stage], known[stage .. ':attempt'], known[stage .. ':t_submit'] = nil, nil, nil end
  redis.call('XADD', tasks_key(wf, stage, version), '*', 'wf', id, 's', stage, 'a', attempt)
end

-- Move a workflow to a terminal state, once. Callers checked it was live.
-- Partial outputs stay (labelled by stage); edge logs go; the rest expires.
-- The keys it may touch, to declare: the workflow's wf, stages, log, done, its cell's tomb:<id>,
-- inflight, notify and ends, and out:<s> of every final stage and edge:<a>:<b> of every edge it has.
-- The record fields it reads (`hread`: a caller that reads the record first reads them with it); the
-- record's and stage hash's writes, the caller's buffered ones included, are written here (`hflush`).
--@const
local FINAL_REC = {'stages', 'edges', 'finals', 'webhook', 'state', 'created_ms', 'blobs', 'tenant', 'tf', 'sl',
  'ko'}

local function finalize(wf, inflight_key, prefix, id, state, err, err_stage, now, tomb_ttl, result_ttl)
  local cell = cell_base(wf)
  hread(wf, FINAL_REC)
  local sk = stages_of(wf)
  local rec = {}
  for i = 1, #FINAL_REC do local f = FINAL_REC[i] rec[i] = hget(wf, f) or false end
  hset(wf, 'state', state, 'finished_ms', now, 'updated_ms', now)
  if rec[9] then       -- counted in its tenant's live workflows at submit (fair share): no longer
    local tinf = key(cell .. ':tinf')
    -- a tenant at 0 keeps its field (one per tenant), and when it got there: it keeps its share a while
    if redis.call('HINCRBY', tinf, rec[8], -1) <= 0 then redis.call('HSET', key(cell .. ':tseen'), rec[8], now) end
  end
  index_state(wf, id, rec[5], state, rec[6] or now)
  if err and err ~= '' then
    hset(wf, 'error', err, 'error_stage', err_stage or '')
  end
  if state ~= 'completed' then
    local stages = csv_ro(rec[1])
    hread(sk, stages)
    for j = 1, #stages do
      local stage = stages[j]
      local st = hget(sk, stage)
      if not stage_terminal(st) then
        if stage == err_stage and state == 'failed' then
          hset(sk, stage, 'failed', stage .. ':t_end', now)
        else
          hset(sk, stage, 'aborted', stage .. ':t_end', now)
        end
      end
    end
    redis.call('SET', key(cell .. ':tomb:' .. id), state, 'EX', tomb_ttl)
    redis.call('PUBLISH', prefix .. ':abort', id)     -- a channel, not a key: reaches every node
  end
  redis.call('ZREM', key(inflight_key), id)
  -- the edge logs and outputs are named by the record (its pipeline version's edges and finals):
  -- under this workflow's base key, so in this script's slot whether or not the caller declared them
  -- (one that ends a workflow by id alone, an abort or a deadline, need not know its pipeline)
  local edge_keys = {}
  local wf_edges = csv_ro(rec[2])
  for j = 1, #wf_edges do edge_keys[j] = wf .. ':edge:' .. wf_edges[j] end
  if #edge_keys > 0 then redis.call('UNLINK', unpack(edge_keys)) end
  -- chunk payloads too large for their edge entries (omniflow.dataplane): nothing reads them any more.
  -- Their names are the set's members (data, written by the emits that stored them): not declared
  -- here, but under this workflow's base key, so in this script's slot.
  if rec[7] then
    local blobs = redis.call('SMEMBERS', key(wf .. ':blobs'))
    for j = 1, #blobs do redis.call('UNLINK', blobs[j]) end
    redis.call('UNLINK', wf .. ':blobs')
  end
  hflush()
  log_event(key(wf .. ':log'), {'t', 'terminal', 'state', state, 'error', err or '', 'stage', err_stage or ''})
  -- one entry, ever: a waiter that wants the outcome and not the progress blocks here (wakes once)
  redis.call('XADD', key(wf .. ':done'), '*', 'state', state)
  -- and in its cell's stream of ends: one read for a watcher of many, however many it watches
  redis.call('XADD', key(cell .. ':ends'), 'MAXLEN', '~', ENDS_MAX_LEN, '*', 'wf', id, 'state', state)
  redis.call('EXPIRE', wf .. ':done', result_ttl)
  redis.call('EXPIRE', wf, result_ttl)
  if sk ~= wf then redis.call('EXPIRE', sk, result_ttl) end
  redis.call('EXPIRE', wf .. ':log', result_ttl)
  -- the finals whose outputs are keys (`ko`: audio streams; text is in the record), else (a record of
  -- before) every final's
  local outs = csv_ro(rec[11] or rec[3])
  for j = 1, #outs do redis.call('EXPIRE', wf .. ':out:' .. outs[j], result_ttl) end
  if rec[4] and rec[4] ~= '' then
    -- bounded: without a jobs runner reading it, the oldest notifications go first
    redis.call('XADD', key(cell .. ':notify'), 'MAXLEN', '~', NOTIFY_MAX_LEN, '*', 'wf', id, 'state', state)
  end
end

-- Edge logs. One script call appends ONE entry per edge it writes to: field `m` holds the msgpack
-- array of its chunks (each a flat field list {'seq', n, 'a', attempt, 'd', payload} or the
-- end-of-stream {'eos', '1', 'seq', n, 'a', attempt}). When a session of <dst> is already bound to a
-- worker, the same entry is copied to that worker's inbox in this cell (`<cell>:inbox:<replica>`,
-- fields wf, ds (dst stage), da (dst attempt), src, m): a worker reads one stream per cell for all
-- its sessions' inputs. Not when that worker is the caller (`SELF`): it hands the chunks of a call
-- that wrote them to its own session in memory (omniflow.engine.session.consumers.LocalInputs).
--
-- The inbox's name is the consuming replica, which the producer learns (`omniflow.engine.session
-- .consumers`): a producer declares the inboxes of the replicas it knows consume each downstream
-- stage, and a call that would forward to another one is refused before it writes anything
-- (`unbound_inbox`), telling the producer which replica to declare when it sends the call again.
local function inbox_key(wf, replica)
  return cell_base(wf) .. ':inbox:' .. replica
end
-- The replica making this call, when it hands what it writes for its own sessions to them in memory
-- (emit.lua's ARGV[8]): a consumer bound to it gets no inbox copy (false: every bound consumer does);
-- LOCAL lists them (dst, dst attempt, ...), for the caller.
local SELF = false
local LOCAL = {}
-- {status, replica, attempt} of stage dst (the stage hash, read once per call; a caller that reads
-- the stage hash first may fill it: emit.lua)
local bound = {}
local function consumer_of(wf, dst)
  local cur = bound[dst]
  if cur == nil then
    cur = redis.call('HMGET', stages_of(wf), dst, dst .. ':replica', dst .. ':attempt')
    bound[dst] = cur
  end
  return cur
end

-- Before a call writes anything: is one of the downstream stages `dsts` bound to a replica whose
-- inbox the caller did not declare? Returns {dst, replica} of the first such, or nil.
local function unbound_inbox(wf, dsts)
  for j = 1, #dsts do
    local dst = dsts[j]
    local cur = consumer_of(wf, dst)
    if (cur[1] == 'waiting_input' or cur[1] == 'running') and cur[2] and cur[2] ~= SELF
        and not DECLARED[inbox_key(wf, cur[2])] then
      return {dst, cur[2]}
    end
  end
  return nil
end
-- Entries written before the claim are in the edge log, which claim.lua returns (catch-up); after
-- it, in the inbox. `edge_append` buffers; `flush_edges` writes (once per script call).
local edges = {}           -- dst -> {edge key, chunks, inbox key or false, dst attempt, src, id}
local edge_order = {}

local function edge_append(wf, id, src, dst, fields)
  local e = edges[dst]
  if e == nil then
    local cur = consumer_of(wf, dst)
    local inbox = false
    if (cur[1] == 'waiting_input' or cur[1] == 'running') and cur[2] then
      if cur[2] ~= SELF then
        inbox = key(inbox_key(wf, cur[2]))
      else
        local n = #LOCAL
        LOCAL[n + 1], LOCAL[n + 2] = dst, tostring(cur[3])
      end
    end
    e = {key(wf .. ':edge:' .. src .. ':' .. dst), {}, inbox, cur[3], src, id}
    edges[dst] = e
    edge_order[#edge_order + 1] = dst
  end
  local chunks = e[2]
  chunks[#chunks + 1] = fields
end

-- A msgpack array of `chunks`, each a flat field list: a table, packed here, or a string the caller
-- packed already (emit.lua's op 'P'): an array is its header and then its items' encodings.
local function pack_chunks(chunks)
  local n = #chunks
  local parts = {}
  for i = 1, n do
    local c = chunks[i]
    if type(c) == 'string' then parts[i] = c else parts[i] = cmsgpack.pack(c) end
  end
  local head
  if n < 16 then
    head = string.char(0x90 + n)
  elseif n < 65536 then
    head = string.char(0xdc, math.floor(n / 256), n % 256)
  else
    head = string.char(0xdd, math.floor(n / 16777216) % 256, math.floor(n / 65536) % 256, math.floor(n / 256) % 256, n % 256)
  end
  return head .. table.concat(parts)
end

local function flush_edges()
  for j = 1, #edge_order do
    local dst = edge_order[j]
    local e = edges[dst]
    local m = pack_chunks(e[2])
    redis.call('XADD', e[1], '*', 'm', m)
    if e[3] then
      redis.call('XADD', e[3], '*', 'wf', e[6], 'ds', dst, 'da', e[4], 'src', e[5], 'm', m)
    end
  end
  edges, edge_order = {}, {}
end

-- The terminal set: every final stage finished AND every submitted stage (attempt > 0) finished.
-- `finished` is a list of stage names; finals and required are csv fields of the record.
local function terminal_set_complete(sk, finished, finals, required)
  local final_list = csv_ro(finals)
  for j = 1, #final_list do
    local s = final_list[j]
    if not contains(finished, s) then return false end
  end
  local stages = csv_ro(required)
  local fields = {}
  for i = 1, #stages do local s = stages[i] fields[i] = s .. ':attempt' end
  hread(sk, fields)
  for j = 1, #stages do
    local s = stages[j]
    if tonumber(hget(sk, s .. ':attempt')) > 0 and not contains(finished, s) then return false end
  end
  return true
end

-- Has this call declared every key `finalize` may touch to complete workflow `wf` (its record's
-- FINAL_REC fields read: `hread`)? A finish that completes the terminal set ends the workflow itself
-- only then (see finish_session); else it reports to the reconciler, as it would without.
local function finalize_declared(wf, inflight_key)
  local cell = cell_base(wf)
  local need = {inflight_key, wf .. ':log', wf .. ':done', cell .. ':ends', cell .. ':idx:state:completed'}
  if hget(wf, 'sl') ~= '1' then need[#need + 1] = wf .. ':stages' end
  if hget(wf, 'state') == 'running' then need[#need + 1] = cell .. ':idx:state:running' end
  if hget(wf, 'tf') then
    need[#need + 1] = cell .. ':tinf'
    need[#need + 1] = cell .. ':tseen'
  end
  local hook = hget(wf, 'webhook')
  if hook and hook ~= '' then need[#need + 1] = cell .. ':notify' end
  if hget(wf, 'blobs') then need[#need + 1] = wf .. ':blobs' end
  local final_list = csv_ro(hget(wf, 'finals'))
  for j = 1, #final_list do need[#need + 1] = wf .. ':out:' .. final_list[j] end
  local edge_list = csv_ro(hget(wf, 'edges'))
  for j = 1, #edge_list do need[#need + 1] = wf .. ':edge:' .. edge_list[j] end
  for j = 1, #need do
    local k = need[j]
    if not DECLARED[k] then return false end
  end
  return true
end

-- Would the reconciler, given a `done` report of <stage>, do more than add it to `finished`?
-- Yes when a `full`-edge group still waits on the stage (its successors may be due), or when the
-- stage completes the terminal set (every final finished AND every submitted stage finished).
-- rec = HMGET of the record's 'stages', 'finals', 'finished', 'groups', 'gsub'.
-- The third answer: true when what it would do is complete the workflow (and nothing else).
local function done_needs_reconciler(sk, stage, rec)
  local finished = csv(rec[3])
  if contains(finished, stage) then return true, finished, false end       -- let the reconciler say 'duplicate'
  if rec[4] and rec[4] ~= '[]' and rec[4] ~= '' then
    local gsub = csv(rec[5])
    local groups = cjson.decode(rec[4])
    for i = 1, #groups do local g = groups[i]
      if not contains(gsub, tostring(i)) and contains(g['after'], stage) then return true, finished, false end
    end
  end
  finished[#finished + 1] = stage
  local complete = terminal_set_complete(sk, finished, rec[2], rec[1])
  return complete, finished, complete
end

-- Close one session (outcome 'done' or 'failed') and report it to the reconciler.
-- The task is acked, fenced or not (a fenced session must not be redelivered), except when the
-- session's own claim is not recorded (see below).
-- `seq` is the number of steps the session emitted: a `done` whose steps are not all stored (a
-- write was refused or lost on the way) is closed as a retryable failure instead, and 'gap' is
-- returned: a stage is never done over a hole (the retry resumes from what was stored).
-- A `done` report that would change nothing but the workflow's `finished` set (no `full`-edge
-- successor waits on the stage, and the terminal set is not complete yet) is applied here, in
-- the same atomic step, instead of being sent: the reconciler hears about the decisions it has
-- to make (completion, successors, failures, retries), not about every stage (DESIGN §2).
-- `meter` (optional): {usage key, its expiry (epoch s; 0: leave it), compute ms, prompt tokens,
-- completion tokens}: what the session adds to its hour's usage (omniflow/storage/usage.py), here,
-- once per session; a done session's compute is also kept in the stage hash (`<stage>:compute_ms`).
-- Returns 'ok' | 'fenced' | 'gap'.
-- Keys to declare: wf, stages, log, the task stream, the events stream, edge:<stage>:<dst> per dst,
-- and the meter's usage key.
local function meter_session(stage, outcome, tenant, pipeline, m, samples, sr)
  local ukey = key(m[1])
  local base, who = (pipeline or '') .. '|' .. stage .. '|', '|' .. (tenant or '')
  local compute = tonumber(m[3])
  if outcome == 'done' then
    redis.call('HINCRBY', ukey, base .. 'sessions' .. who, 1)
    if compute > 0 then redis.call('HINCRBY', ukey, base .. 'compute_ms' .. who, compute) end
    samples, sr = tonumber(samples or '0') or 0, tonumber(sr or '0') or 0
    if samples > 0 and sr > 0 then
      redis.call('HINCRBY', ukey, base .. 'audio_ms' .. who, math.floor(samples * 1000 / sr))
    end
    if tonumber(m[4]) > 0 then redis.call('HINCRBY', ukey, base .. 'prompt_tokens' .. who, m[4]) end
    if tonumber(m[5]) > 0 then redis.call('HINCRBY', ukey, base .. 'completion_tokens' .. who, m[5]) end
  elseif compute > 0 then
    redis.call('HINCRBY', ukey, base .. 'failed_compute_ms' .. who, compute)
  end
  -- the worker asks once per hour's key (what it already set stays set)
  if tonumber(m[2]) > 0 then redis.call('EXPIREAT', ukey, m[2]) end
end

-- The record fields finish_session reads (HMGET, in this order: a caller that read them already
-- passes them).
--@const
local FINISH_REC = {'state', 'id', 'stages', 'finals', 'finished', 'groups', 'gsub', 'tenant', 'pipeline',
  'pipeline_hash', 'prio'}
-- FINISH_REC and then the rest of what finalize reads (FINAL_REC): a finish that may end its workflow
--@const
local FINISH_FINAL_REC = {'state', 'id', 'stages', 'finals', 'finished', 'groups', 'gsub', 'tenant', 'pipeline',
  'pipeline_hash', 'prio', 'edges', 'webhook', 'created_ms', 'blobs', 'tf', 'ko'}

-- What finish_session reads without `pre`, with one HMGET where the stage fields are in the record:
-- a caller that reads the stage hash before it (finish.lua's `unbound_inbox`) calls this first.
local function finish_prefetch(wf, stage)
  local sf = {stage, stage .. ':attempt', stage .. ':seq', stage .. ':samples', stage .. ':sr'}
  local fields = {'sl'}
  for j = 1, #FINISH_REC do fields[#fields + 1] = FINISH_REC[j] end
  for j = 1, #sf do fields[#fields + 1] = sf[j] end
  hread(wf, fields)
  local sk = stages_of(wf)
  if sk ~= wf then hread(sk, sf) end
  return sk, sf
end

-- `pre` (optional): what the caller read already: {rec = HMGET of FINISH_REC, cur = this stage's
-- {status, attempt, seq, samples, sr} as the caller's buffered writes leave them, z = {inflight set,
-- result ttl s} when the caller may end the workflow itself}. With `z`, a `done` that completes the
-- terminal set is not reported: `pre.completing` is set to the new `finished` csv, and the caller
-- calls `finalize` once its own writes are done (its edges flushed), when it declared every key
-- finalize touches (`finalize_declared`): the same transition the reconciler would apply to the
-- report, one hop and one script call sooner.
-- The record's and the stage fields' writes are buffered (`hset`, after the caller's own): one HSET
-- per hash when the caller calls `hflush` (finalize does).
local function finish_session(wf, tasks_key, events_key, group, entry_id, stage, attempt, outcome,
                              detail, retryable, now, seq, downstream, meter, pre)
  local sk, rec, cur
  if pre then
    sk, rec, cur = stages_of(wf), pre.rec, pre.cur
  else
    local sf
    sk, sf = finish_prefetch(wf, stage)
    rec, cur = {}, {}
    for i = 1, #FINISH_REC do local f = FINISH_REC[i] rec[i] = hget(wf, f) or false end
    for i = 1, #sf do local f = sf[i] cur[i] = hget(sk, f) or false end
  end
  -- (cur[2]: a reply's string or false/nil; attempt: an ARGV string: compared as they are, no tostring)
  if is_live(rec[1]) and cur[2] == attempt and cur[1] == 'pending' then
    -- this attempt's claim is not recorded (lost with a primary that failed over after answering
    -- it): its task stays pending for this worker, whose orphan audit claims it again. Acked here,
    -- it would leave the stage pending with no task: nobody would ever run it.
    return 'fenced'
  end
  -- acked, not deleted: the workers reading the stream trim what every group has acked
  -- (trim_tasks.lua), one command less per session
  redis.call('XACK', key(tasks_key), group, entry_id)
  if not is_live(rec[1]) or cur[2] ~= attempt then return 'fenced' end
  if cur[1] ~= 'running' and cur[1] ~= 'waiting_input' then return 'fenced' end
  local res = 'ok'
  local stored = tonumber(cur[3] or '0') or 0
  if outcome == 'done' and stored < tonumber(seq) then
    outcome, retryable, res = 'failed', '1', 'gap'
    detail = 'steps ' .. (stored + 1) .. '..' .. seq .. ' of attempt ' .. attempt .. ' were not stored (a write was refused or lost)'
  end
  local report = true
  if outcome == 'done' then
    local down = csv_ro(downstream)
    for j = 1, #down do
      local dst = down[j]
      edge_append(wf, rec[2], stage, dst, {'eos', '1', 'seq', seq, 'a', attempt})
    end
    if meter then
      hset(sk, stage, 'done', stage .. ':t_end', now, stage .. ':usage', detail, stage .. ':compute_ms', meter[3])
    else
      hset(sk, stage, 'done', stage .. ':t_end', now, stage .. ':usage', detail)
    end
    local finished, complete
    report, finished, complete = done_needs_reconciler(sk, stage, {rec[3], rec[4], rec[5], rec[6], rec[7]})
    if not report then
      hset(wf, 'finished', table.concat(finished, ','), 'updated_ms', now)
    elseif complete and pre and pre.z and finalize_declared(wf, pre.z[1]) then
      report, pre.completing = false, table.concat(finished, ',')
    end
  else
    hset(sk, stage, 'failed', stage .. ':t_end', now, stage .. ':error', detail)
  end
  if meter then meter_session(stage, outcome, rec[8], rec[9], meter, cur[4], cur[5]) end
  log_event(key(wf .. ':log'), {'t', 'stage', 'stage', stage, 'status', outcome, 'attempt', attempt})
  if report then
    -- 'c': the workflow's class (the reconciler declares that class's task streams only)
    redis.call('XADD', key(events_key), '*', 't', outcome, 'wf', rec[2], 's', stage, 'a', attempt, 'd', detail,
      'r', retryable, 'p', rec[10] or '', 'c', (rec[11] and rec[11] ~= '') and rec[11] or 'api')
  end
  return res
end

-- Is `m` a well-formed meter (see finish_session)?
local function valid_meter(m)
  return type(m) == 'table' and type(m[1]) == 'string' and tonumber(m[2]) ~= nil and tonumber(m[3]) ~= nil
    and tonumber(m[4]) ~= nil and tonumber(m[5]) ~= nil
end

-- Is `z` a well-formed completion (a finish's 9th item: {inflight set key, result ttl s[, stages csv]})?
local function valid_completion(z)
  return type(z) == 'table' and type(z[1]) == 'string' and tonumber(z[2]) ~= nil
    and (z[3] == nil or type(z[3]) == 'string')
end

-- Is `f` a well-formed finish (the msgpack array emit.lua's ARGV[8] carries)?
-- {group, entry id, outcome, detail, retryable, last seq, downstream csv[, meter or false[, completion]]}
local function valid_finish(f)
  return type(f) == 'table' and type(f[1]) == 'string' and type(f[2]) == 'string'
    and (f[3] == 'done' or f[3] == 'failed') and type(f[4]) == 'string'
    and (type(f[5]) == 'string' or type(f[5]) == 'number') and tonumber(f[6]) ~= nil
    and type(f[7]) == 'string' and (not f[8] or valid_meter(f[8])) and (f[9] == nil or valid_completion(f[9]))
end
