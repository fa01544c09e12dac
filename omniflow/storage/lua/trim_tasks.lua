#!lua flags=allow-oom
-- trim_tasks: delete the task entries that every group of their stream has done with. A session's
-- finish acknowledges its task and leaves the entry (`finish_session` in _lib.lua: one command less
-- per session); the workers reading a stream call this every `TRIM_S` (omniflow.engine.worker.intake).
-- An entry goes only once it is delivered (at or before the group's last-delivered-id) and
-- acknowledged (below its group's oldest pending entry): what is queued or held stays, so a lapsed
-- worker's tasks are still there to re-queue. allow-oom: it only frees memory.
-- KEYS: task streams of one cell. Returns the number of entries deleted.
local function before(a, b)          -- stream ids 'ms-seq': is a < b?
  local am, as = string.match(a, '^(%d+)-(%d+)$')
  local bm, bs = string.match(b, '^(%d+)-(%d+)$')
  am, bm = tonumber(am), tonumber(bm)
  if am ~= bm then return am < bm end
  return tonumber(as) < tonumber(bs)
end

local trimmed = 0
for i = 1, #KEYS do
  local stream = KEYS[i]
  if redis.call('XLEN', stream) > 0 then
    local groups = redis.call('XINFO', 'GROUPS', stream)
    local keep                       -- the oldest entry some group still needs
    for j = 1, #groups do
      local row, g = groups[j], {}
      for f = 1, #row, 2 do g[row[f]] = row[f + 1] end
      local bound
      if tonumber(g['pending']) > 0 then
        bound = redis.call('XPENDING', stream, g['name'])[2]
      else
        local ms, seq = string.match(g['last-delivered-id'], '^(%d+)-(%d+)$')
        bound = ms .. '-' .. string.format('%d', tonumber(seq) + 1)
      end
      if keep == nil or before(bound, keep) then keep = bound end
    end
    if keep then trimmed = trimmed + redis.call('XTRIM', stream, 'MINID', keep) end
  end
end
return trimmed
