-- purge: delete one finished workflow's keys and its listing index entries, in one step; a workflow
-- that is live again (its record says pending or running) is left as it is.
-- KEYS[1] wf base key; KEYS[2 .. ARGV[2] + 1] the workflow's keys to delete (stages, log, done,
--   out:<s> of each final stage, its idempotency key); the rest: the listing indexes of its cell to
--   remove it from (all, every state index, its tenant's index). All of one cell.
-- ARGV[1] workflow id  ARGV[2] how many keys after KEYS[1] to delete
-- Returns 'purged' | 'live'
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'pending' or state == 'running' then return 'live' end
local n = tonumber(ARGV[2])
redis.call('UNLINK', KEYS[1], unpack(KEYS, 2, n + 1))
for i = n + 2, #KEYS do
  redis.call('ZREM', KEYS[i], ARGV[1])
end
return 'purged'
