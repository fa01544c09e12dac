-- lease: take or renew a lease held by one owner (the reconciler's leader lease), in one step.
-- KEYS[1] the lease key
-- ARGV[1] owner id  ARGV[2] lease ttl ms
-- Returns 'taken' (it was free: now ours) | 'renewed' (it was ours: extended) | 'held' (another owner's)
local cur = redis.call('GET', KEYS[1])
if not cur then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 'taken'
end
if cur == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 'renewed'
end
return 'held'
