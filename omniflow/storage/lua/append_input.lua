-- append_input: add a client's streamed input (audio chunks) to a running workflow, optionally ending it.
-- KEYS[1] wf base key  KEYS[2] its stage hash  KEYS[3] edge:@input:<stage> (all of one cell)
-- KEYS[4..] the inboxes of the replicas the caller knows consume the stage (`<cell>:inbox:<replica>`)
-- ARGV[1] workflow id  ARGV[2] the stage that reads the input  ARGV[3] '1' to end the input after these
-- ARGV[4..] the chunks' payloads (codec-encoded, each one chunk of the edge log)
-- The chunks are numbered here (`@input:seq` in the stage hash), so concurrent or retried appends never
-- collide; like an emit's, they form ONE edge entry, copied to the consuming worker's inbox when a
-- session of the stage is bound (edge_append/flush_edges in _lib.lua).
-- Returns {'ok', last seq} | {'closed', last seq} (the input was ended already: nothing written)
--       | {'ended', state} (the workflow is terminal or gone: nothing written)
--       | {'no_input', ''} (the workflow takes no streamed input at this stage)
--       | {'inbox', stage, replica} (the stage is bound to a replica whose inbox is not in KEYS: nothing written)
--@include _lib.lua
local wf, id, stage = KEYS[1], ARGV[1], ARGV[2]
local rec, sk, cur = read_record(wf, {'state', 'edges'}, {'@input:seq', '@input:eos'})
if not rec[1] then return {'ended', 'gone'} end
if not contains(csv(rec[2]), '@input:' .. stage) then return {'no_input', ''} end
if not is_live(rec[1]) then return {'ended', rec[1]} end
local seq = tonumber(cur[1] or '0')
if cur[2] then return {'closed', seq} end
local missing = unbound_inbox(wf, {stage})
if missing then return {'inbox', missing[1], missing[2]} end
for i = 4, #ARGV do
  seq = seq + 1
  edge_append(wf, id, '@input', stage, {'seq', seq, 'a', 1, 'd', ARGV[i]})
end
if ARGV[3] == '1' then
  seq = seq + 1
  edge_append(wf, id, '@input', stage, {'eos', '1', 'seq', seq, 'a', 1})
  redis.call('HSET', sk, '@input:seq', seq, '@input:eos', '1')
elseif #ARGV >= 4 then
  redis.call('HSET', sk, '@input:seq', seq)
end
flush_edges()
return {'ok', seq}
