-- realtime_save: write a realtime session's state, fenced by the connection that owns the session.
-- A reconnecting client's new connection claims the session ('claim'); from then on only it may
-- write the state, so a half-open old connection that finishes a turn late cannot overwrite what
-- the new one did ('save' answers 'taken' to it, and it closes).
-- KEYS[1] the session's hash (`owner`, `state`, `tenant`)
-- ARGV[1] mode: 'create' (a new session; fails if the id exists) | 'claim' (take an existing one
--         over) | 'save' (write, only as its owner)
-- ARGV[2] connection id  ARGV[3] state JSON ('' with 'claim': keep it)  ARGV[4] ttl s  ARGV[5] tenant
-- Returns {'ok', state} (state: the stored JSON after the call) | {'gone'} | {'taken'} | {'exists'}
local mode = ARGV[1]
if mode == 'create' then
  if redis.call('EXISTS', KEYS[1]) == 1 then return {'exists'} end
  redis.call('HSET', KEYS[1], 'owner', ARGV[2], 'state', ARGV[3], 'tenant', ARGV[5])
  redis.call('EXPIRE', KEYS[1], ARGV[4])
  return {'ok', ARGV[3]}
end
local cur = redis.call('HMGET', KEYS[1], 'owner', 'state', 'tenant')
if not cur[2] then return {'gone'} end
if cur[3] ~= ARGV[5] then return {'gone'} end       -- another tenant's session: as if it did not exist
if mode == 'claim' then
  redis.call('HSET', KEYS[1], 'owner', ARGV[2])
  redis.call('EXPIRE', KEYS[1], ARGV[4])
  return {'ok', cur[2]}
end
if cur[1] ~= ARGV[2] then return {'taken'} end
redis.call('HSET', KEYS[1], 'state', ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[4])
return {'ok', ARGV[3]}
