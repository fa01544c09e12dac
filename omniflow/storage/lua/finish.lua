-- finish: a session ends (done or failed); ack its task and report to the reconciler what it must
-- decide (a failure; a `done` that completes the terminal set or may release `full`-edge successors).
-- A `done` that would only join the `finished` set is applied here (see finish_session in _lib.lua).
-- KEYS[1] wf base key  KEYS[2] the stage's task stream  KEYS[3] events stream (of the workflow's cell)
-- KEYS[4] stage hash (of a workflow whose stage fields are not in its record: see stages_of in
--   _lib.lua)  KEYS[5] log  KEYS[6..] edge:<stage>:<dst> of each downstream stage, then the
--   inbox of each replica known to consume one of them (see unbound_inbox in _lib.lua)
-- ARGV[1] group  ARGV[2] task entry id  ARGV[3] stage  ARGV[4] attempt
-- ARGV[5] outcome 'done'|'failed'  ARGV[6] usage JSON (done) or error message (failed)
-- ARGV[7] '1' if the failure is retryable  ARGV[8] now_ms  ARGV[9] last seq emitted
-- ARGV[10] downstream stages csv (an end-of-stream entry goes on each edge)
-- The task is always acked: a fenced session must not be redelivered.
-- (emit.lua can carry the same finish after a session's last steps, saving a call.)
-- Returns 'ok' | 'fenced' | 'gap' (steps of this attempt are missing: closed as a retryable failure)
--       | {'inbox', dst, replica} (a done: dst is bound to replica, whose inbox is not in KEYS; nothing
--         written: send the call again declaring it)
--@include _lib.lua
if tonumber(ARGV[9]) == nil or (ARGV[5] ~= 'done' and ARGV[5] ~= 'failed') then
  return redis.error_reply('finish: malformed arguments (outcome ' .. tostring(ARGV[5]) .. ', seq ' .. tostring(ARGV[9]) .. ')')
end
finish_prefetch(KEYS[1], ARGV[3])    -- the record and this stage's fields, before unbound_inbox reads
if ARGV[5] == 'done' then
  local unbound = unbound_inbox(KEYS[1], csv(ARGV[10]))
  if unbound then return {'inbox', unbound[1], unbound[2]} end
end
local res = finish_session(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5],
  ARGV[6], ARGV[7], ARGV[8], ARGV[9], ARGV[10])
flush_edges()
hflush()
flush_log()
return res
