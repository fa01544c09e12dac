#!lua flags=no-writes
-- list_scan: which of some workflows' records match the filters no index serves (read-only).
-- Used by `omniflow.storage.listing`: the caller reads a bounded step of a listing index
-- (ZREVRANGE) and passes those records here, so one call reads a bounded number of records and
-- holds the server for a bounded time (~1-2 us per record).
-- KEYS[1..n] the records (wf base keys) to check, in index order, all of one cell
-- ARGV[1] most matches  ARGV[2] state ('' any)  ARGV[3] '1' to filter by tenant  ARGV[4] tenant
-- ARGV[5] stage in the workflow's plan ('' any)  ARGV[6] request-id substring ('' any)
-- ARGV[7] created at or after this epoch ms ('' or absent: any; the walked index is not scored by
--         creation: the pending workflows' `inflight`, by deadline)
-- Returns {records read, position in KEYS of each matching record, ...}
local want = tonumber(ARGV[1])
local state, by_tenant, tenant, stage, rid = ARGV[2], ARGV[3] == '1', ARGV[4], ARGV[5], ARGV[6]
local since = tonumber(ARGV[7] or '')
local needle = ',' .. stage .. ','
local out = {0}
local scanned = 0
for i, rkey in ipairs(KEYS) do
  scanned = i
  local r = redis.call('HMGET', rkey, 'state', 'tenant', 'stages', 'request_id', 'created_ms')
  if r[1] and (state == '' or r[1] == state) and (not by_tenant or r[2] == tenant)
      and (stage == '' or string.find(',' .. (r[3] or '') .. ',', needle, 1, true))
      and (rid == '' or string.find(r[4] or '', rid, 1, true))
      and (not since or (tonumber(r[5]) or 0) >= since) then
    out[#out + 1] = i
    if #out - 1 >= want then break end
  end
end
out[1] = scanned
return out
