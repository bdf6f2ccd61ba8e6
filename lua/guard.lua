--[[
  guard.lua: create or roll back the guard of one segment of a spread store.

  A spread store (Redis Cluster, segments on several nodes) keeps, next to each
  segment k > 0, a guard hash P:{I%s<k>}:g holding a copy of the header's guard
  fields ('epoch', 'version', 'kv', 'lv:<n>'); every call on the segment checks it
  (tds_check) as calls on segment 0 check the header, which lives on another node. A
  schema change moves every guard to the new versions (prepare) before it commits the
  header, so clients of the old schema are refused on a prepared segment for what the
  change touches until the commit, and no one writes a segment under a schema it
  does not hold.

  KEYS[1]     the segment's guard hash
  KEYS[2..]   rollback: keys to delete (data left by the change rolled back)
  ARGV[1]     'ensure' or 'rollback'
  ensure:
    ARGV[2]   epoch of the store
    ARGV[3]   the header's version: a missing guard is created at it
    ARGV[4]   the store's deadline in Unix milliseconds (the header's), '' for none: a new
              guard expires with the store, and write.lua gives the keys it creates in the
              segment the guard's time to live
  rollback:
    ARGV[2]   epoch of the store
    ARGV[3]   the header's version, which the guard goes back to
    ARGV[4]   token of the change rolled back, or '*' for any change (the caller
              holds the schema lock, so no change is in flight)
    ARGV[5]   the header's other guard fields, 'name=value' words ('kv=3 lv:0=1 lv:2=3'):
              the guard gets exactly these ('lv:' fields not named are deleted)

  Reply       ensure: {'OK', version of the guard}; {'STALE', guard...} when the guard
              belongs to another creation of the store (another epoch).
              rollback: {'OK', 1} when the guard was ahead and went back (and KEYS[2..]
              were deleted), {'OK', 0} when there was nothing to undo.
  Errors      'TDSTORE bad argument' for an unknown mode; 'TDSTORE damaged' when the guard's
              version is not an integer >= 0.
]]
local guard = KEYS[1]
local mode, epoch = ARGV[1], ARGV[2]
local version = tds_num(ARGV[3], 'version')
local have = redis.call('HMGET', guard, 'epoch', 'version', 'lk')
if mode == 'ensure' then
  if have[1] and have[1] ~= epoch then
    return tds_stale(guard)
  end
  if not have[1] then
    redis.call('HSET', guard, 'epoch', epoch, 'version', ARGV[3])
  end
  -- the store's deadline now, also for a guard an earlier, rolled-back first change made
  if ARGV[4] ~= nil and ARGV[4] ~= '' then
    redis.call('PEXPIREAT', guard, tds_num(ARGV[4], 'deadline'))
  else
    redis.call('PERSIST', guard)
  end
  return {'OK', have[2] or ARGV[3]}
end
if mode ~= 'rollback' then
  error('TDSTORE bad argument: guard mode ' .. tostring(mode))
end
if have[1] ~= epoch or tds_int_field(have[2], 'version (of the guard)', 0, TDS_MAXINT, 0) <= version or (ARGV[4] ~= '*' and have[3] ~= ARGV[4]) then
  return {'OK', 0}
end
redis.call('HSET', guard, 'version', ARGV[3])
redis.call('HDEL', guard, 'lk')
local keep = {}
for name, value in string.gmatch(ARGV[5] or '', '([%w:]+)=(%d+)') do
  redis.call('HSET', guard, name, value)
  keep[name] = true
end
local all = redis.call('HKEYS', guard)
for _, name in ipairs(all) do
  if string.sub(name, 1, 3) == 'lv:' and not keep[name] then
    redis.call('HDEL', guard, name)
  end
end
for i = 2, #KEYS do
  redis.call('DEL', KEYS[i])
end
return {'OK', 1}
