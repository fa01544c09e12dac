-- dead_letter: move one poison stream entry to a dead-letter stream, with the reason, in one step.
-- KEYS[1] dead-letter stream  KEYS[2] the stream the entry came from
-- ARGV[1] consumer group the entry is pending in ('' for none: a plain XREAD stream)
-- ARGV[2] entry id  ARGV[3] dead-letter stream MAXLEN (approximate)  ARGV[4] reason
-- ARGV[5..] the entry's fields (name, value pairs; possibly none)
-- The XADD comes first: a server that refuses it (OOM, READONLY) refuses the whole call, and the
-- entry stays where it was, unacknowledged.
-- Returns 1
redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[3], '*', 'reason', ARGV[4], 'entry', ARGV[2], 'src', KEYS[2],
  unpack(ARGV, 5))
if ARGV[1] ~= '' then
  redis.call('XACK', KEYS[2], ARGV[1], ARGV[2])
end
redis.call('XDEL', KEYS[2], ARGV[2])
return 1
