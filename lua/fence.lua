--[[
  fence.lua: the fence of a checkpoint taken while writers run (tdstore/_checkpoint/export_import.py):
  the store's header (ring write count, policy counters, policy, epoch and version), its stats
  hash and its time to live, read in one atomic step. Writes nothing.

  The export then reads the rows in chunks (read.lua, each chunk atomic) and the ring write count
  once more after the last: every write past the fence's 'rw' overwrote the slot of one of the
  fence's oldest rows, which the checkpoint keeps absent (see _absent.lua); every other row it
  read is the fence's. Cost: O(header fields + stats fields), a few hundred at most.

  KEYS[1]     store header hash
  KEYS[2]     the store's stats hash (see tds_stat in _lib.lua)
  ARGV[1]     none: the script takes no arguments

  Reply       {'OK', {header field, value, ...}, {stats field, value, ...}, pttl of the header}
              (pttl -1: no time to live); {'GONE'} when the store has no header.
  Errors      none of its own.
]]
local head = redis.call('HGETALL', KEYS[1])
if #head == 0 then
  return {'GONE'}
end
return {'OK', head, redis.call('HGETALL', KEYS[2]), redis.call('PTTL', KEYS[1])}
