#!lua flags=allow-oom
-- heartbeat: renew a worker's lease and publish its info; tell it whether it is draining.
-- allow-oom: a worker must keep its lease while Redis refuses writes for memory, or the reconciler
-- would declare it dead and re-queue its sessions for nothing; a lease is one zset score and a
-- small hash overwritten in place, so this grows nothing.
-- KEYS[1] workers zset (lease expiry ms by worker id)  KEYS[2] the worker's info hash
-- ARGV[1] worker id  ARGV[2] lease expiry ms  ARGV[3] info hash ttl s  ARGV[4..] info field/value pairs
-- Returns the info hash's `drain` field (set by `omniflow drain`), or nil
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
redis.call('HSET', KEYS[2], unpack(ARGV, 4))
redis.call('EXPIRE', KEYS[2], ARGV[3])
return redis.call('HGET', KEYS[2], 'drain')
