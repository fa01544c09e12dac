-- list_scan: walk a listing index newest first and return the ids whose records match (read-only).
-- Used by `omniflow.listing` for the filters no index serves; one call reads at most ARGV[4]
-- records, so it holds the server for a bounded time (~1-2 us per record).
-- KEYS[1] the index zset of one cell (member: workflow id, score: creation ms)
-- ARGV[1] the cell's base `<prefix>:{<cell tag>}`  ARGV[2] first rank  ARGV[3] end rank (exclusive)  ARGV[4] most records to read
-- ARGV[5] most matches  ARGV[6] state ('' any)  ARGV[7] '1' to filter by tenant  ARGV[8] tenant
-- ARGV[9] stage in the workflow's plan ('' any)  ARGV[10] request-id substring ('' any)
-- Returns {next rank, records read, matching id, ...}
-- The records it reads are named by the index's members: data, so not declared in KEYS; they are
-- keys of the index's cell (one slot), and this script writes nothing.
local cell = ARGV[1]
local pos, stop = tonumber(ARGV[2]), tonumber(ARGV[3])
local budget, want = tonumber(ARGV[4]), tonumber(ARGV[5])
local state, by_tenant, tenant, stage, rid = ARGV[6], ARGV[7] == '1', ARGV[8], ARGV[9], ARGV[10]
local needle = ',' .. stage .. ','
local base = cell .. ':wf:'
local out = {0, 0}
local scanned = 0
local last = math.min(stop, pos + budget) - 1
if last >= pos then
  for _, id in ipairs(redis.call('ZREVRANGE', KEYS[1], pos, last)) do
    scanned = scanned + 1
    local r = redis.call('HMGET', base .. id, 'state', 'tenant', 'stages', 'request_id')
    if r[1] and (state == '' or r[1] == state) and (not by_tenant or r[2] == tenant)
        and (stage == '' or string.find(',' .. (r[3] or '') .. ',', needle, 1, true))
        and (rid == '' or string.find(r[4] or '', rid, 1, true)) then
      out[#out + 1] = id
      if #out - 2 >= want then break end
    end
  end
end
out[1] = pos + scanned
out[2] = scanned
return out
