-- reap_consumer: delete a consumer of a group only while it holds no pending entry (atomic: a
-- process declared gone may still be alive and have read entries since it was listed).
-- KEYS[1] stream  ARGV[1] group  ARGV[2] consumer
-- Returns 1 when the consumer is gone (deleted now, or the group or stream is), 0 when kept
local ok, p = pcall(redis.call, 'XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2])
if not ok then return 1 end
if #p > 0 then return 0 end
redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
return 1
