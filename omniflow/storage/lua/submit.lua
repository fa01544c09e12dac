-- submit: create, admit and pre-submit one workflow, or refuse with nothing created.
-- All keys are of the workflow's cell (`<c>` = `<prefix>:{<cell tag>}`):
-- KEYS[1] wf base key   `<c>:wf:<id>`     KEYS[2] its log
-- KEYS[3] inflight zset `<c>:inflight`    KEYS[4] tombstone `<c>:tomb:<id>`
-- KEYS[5] idempotency   `<c>:idem:<len(tenant)>:<tenant>:<key>` (ignored when ARGV[6] == 0; a request
--                       id's cell is the workflow's cell)
-- KEYS[6] all-ids zset  `<c>:all`
-- KEYS[7] tenant index  `<c>:idx:tenant:<tenant>`  KEYS[8] the names of the tenants with an index
--         `<c>:idx:tenants` (neither written for the tenant `default`: its listing walks `<c>:all`,
--         omniflow/storage/listing.py)
-- KEYS[9..] `<c>:tinf` (live per tenant) and `<c>:stage:<s>@<version>:tasks[:<class>]` of each stage
--            in ARGV[8] (version: the record's pipeline_hash; class: the request's priority class,
--            record field `prio`)
-- (a pending workflow is in no state index: the pending ones are `inflight` less `idx:state:running`)
-- ARGV[1] prefix  ARGV[2] id  ARGV[3] now_ms  ARGV[4] deadline_ms
-- ARGV[5] max_in_flight of this cell for the request's priority class  ARGV[6] idempotency ttl s (0: no key)
-- ARGV[7] required stages csv  ARGV[8] stages submitted at admission csv
-- ARGV[9] n record fields, then that many field/value pairs (the first pair is 'tenant', <tenant>)
-- then ARGV[10 + 2n] the tenant's fair share left for this cell ('': no fair-share check),
--      ARGV[11 + 2n] the cell's in-flight count from which the share is enforced and
--      ARGV[12 + 2n] the most the tenant may hold in this cell whatever the others do, once another
--      tenant has used the cell ('': no cap)
-- Returns {'ok', id, the cell's in-flight count now} | {'existing', id} | {'retired', id} | {'exists', id} | {'busy', n}
--       | {'busy', n, tenant, the tenant's live workflows in this cell}   (tenant: the word, over its fair share)
-- ('existing': the request id names a workflow already; whether that one is retired is the
-- caller's question, as its tombstone is a key this call cannot declare)
--@include _lib.lua
local wf, id, now = KEYS[1], ARGV[2], ARGV[3]
local use_idem = tonumber(ARGV[6]) > 0
if use_idem then
  local prev = redis.call('GET', KEYS[5])
  if prev then return {'existing', prev} end
end
if redis.call('EXISTS', KEYS[4], wf) > 0 then      -- one call for both (the second only when one exists)
  if redis.call('EXISTS', KEYS[4]) == 1 then return {'retired', id} end
  return {'exists', id}
end
local n = redis.call('ZCARD', KEYS[3])
if n >= tonumber(ARGV[5]) then return {'busy', tostring(n)} end
local nf = tonumber(ARGV[9])
local tenant = ARGV[11]
local tinf = key(cell_base(wf) .. ':tinf')
local share = tonumber(ARGV[10 + 2 * nf] or '')
local counted = false             -- the tenant's live count taken already (its new value: tenant_new)
local tenant_new
if share then
  local mine
  -- the cap holds once another tenant has used this cell (its field in tinf, even at 0)
  local cap = tonumber(ARGV[12 + 2 * nf] or '')
  local from = tonumber(ARGV[11 + 2 * nf])
  if (n >= from and share <= 0) or (cap and cap <= 0) then
    -- a refusal at 0 is possible: it must leave an absent field absent, so read before counting
    mine = tonumber(redis.call('HGET', tinf, tenant) or '0')
  else
    -- a refusal needs mine >= 1 (share, cap >= 1): count first and take it back if refused,
    -- one command on the path taken (the field existed before whenever it is taken back)
    mine = redis.call('HINCRBY', tinf, tenant, 1) - 1
    counted, tenant_new = true, mine == 0
  end
  local others = cap and mine >= cap and redis.call('HLEN', tinf) > (mine > 0 and 1 or 0)
  if (n >= from and mine >= share) or others then
    if counted then redis.call('HINCRBY', tinf, tenant, -1) end
    return {'busy', tostring(n), 'tenant', tostring(mine)}
  end
end

-- the record and every required stage's fields in one HSET ('sl': the stage fields are in the
-- record, see stages_of in _lib.lua); the admitted stages with attempt 1 (they are queued below).
-- A small hash is a list scanned from its front on every field read or written (lpFind: 72 % of
-- HMGET's and HSET's instructions, bench/notes.md, round 19), so the fields every script reads come
-- first: the record's state, then each stage's status, attempt and seq, then the request's fields
-- (input, params, ...: read by the claim alone), the stages' submit times last (read by no script)
local fields = {'id', id, 'state', 'pending', 'sl', '1', 'tf', '1', 'finished', '', 'gsub', '',
  'created_ms', now, 'updated_ms', now, 'deadline_ms', ARGV[4]}
local admit = csv_ro(ARGV[8])          -- (read only: most often the same list, parsed once)
local required = csv_ro(ARGV[7])
for j = 1, #required do
  local stage = required[j]
  local n = #fields
  fields[n + 1], fields[n + 2], fields[n + 3] = stage, 'pending', stage .. ':attempt'
  fields[n + 4], fields[n + 5], fields[n + 6] = contains(admit, stage) and 1 or 0, stage .. ':seq', 0
end
for i = 10, 9 + 2 * nf do fields[#fields + 1] = ARGV[i] end
for j = 1, #required do
  if contains(admit, required[j]) then
    local n = #fields
    fields[n + 1], fields[n + 2] = required[j] .. ':t_submit', now
  end
end
-- the tenant's first live workflow in this cell (its count was 0 or absent): it joins the names set
-- (never pruned: a tenant with a live workflow is in it already), but `default`, which has no index
if not counted then tenant_new = redis.call('HINCRBY', tinf, tenant, 1) == 1 end
-- the record's priority class and pipeline_hash, among its fields (ARGV[10..]), for tasks_key (no read back)
local version = ''
for i = 10, 8 + 2 * nf, 2 do
  local f = ARGV[i]
  if f == 'prio' then PRIO[wf] = ARGV[i + 1] elseif f == 'pipeline_hash' then version = ARGV[i + 1] end
end
redis.call('HSET', wf, unpack(fields))
for j = 1, #admit do
  redis.call('XADD', tasks_key(wf, admit[j], version), '*', 'wf', id, 's', admit[j], 'a', 1)
end
redis.call('ZADD', KEYS[3], ARGV[4], id)
redis.call('ZADD', KEYS[6], now, id)
-- `default` (omniflow.storage.keys.UNINDEXED_TENANT): the tenant of a deployment without tenants,
-- whose index would repeat `<c>:all` (so it needs no place in the names set either)
if ARGV[11] ~= 'default' then
  redis.call('ZADD', KEYS[7], now, id)
  if tenant_new then redis.call('SADD', KEYS[8], ARGV[11]) end
end
redis.call('XADD', key(wf .. ':log'), '*', 't', 'state', 'state', 'pending')
if use_idem then redis.call('SET', KEYS[5], id, 'EX', ARGV[6]) end
return {'ok', id, n + 1}
