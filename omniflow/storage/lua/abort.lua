-- abort: retire a live workflow (client abort, deadline, input timeout); tombstone its id.
-- KEYS[1] wf base key  KEYS[2] inflight zset of its cell; then what finalize may touch (_lib.lua):
--   stages, log, done, tomb:<id>, notify, out:<s> of each final stage, edge:<a>:<b> of each edge
-- ARGV[1] prefix  ARGV[2] now_ms  ARGV[3] final state 'aborted'|'failed'  ARGV[4] reason
-- ARGV[5] stage blamed ('' for none)  ARGV[6] tombstone ttl s  ARGV[7] result ttl s
-- Returns {'ok', trace} | {'terminal', state} | {'gone'}
--   trace: the workflow's W3C traceparent ('' if none; omniflow.tracing)
--@include _lib.lua
local wf = KEYS[1]
local rec = redis.call('HMGET', wf, 'state', 'id', 'trace')
if not rec[1] then return {'gone'} end
if not is_live(rec[1]) then return {'terminal', rec[1]} end
finalize(wf, KEYS[2], ARGV[1], rec[2], ARGV[3], ARGV[4], ARGV[5], ARGV[2], ARGV[6], ARGV[7])
flush_log()
return {'ok', rec[3] or ''}
