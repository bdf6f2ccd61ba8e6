--[[
  marks.lua: the bases a torchrl StoreStorage (tdstore/_ring/marks.py) keeps in a ring's
  header beside 'rw', so that every process reads the same values.

  'gb' and 'wb' carry the generations and the write count across an emptying (the store is
  deleted and made again): a slot's torchrl generation is 'gb' plus its ring generation, so an
  (index, generation) handle taken before the emptying never looks live again, and
  rb.write_count is 'wb' + 'rw'. (The third torchrl counter, 'tr', the in-place writes, is
  moved by the writes themselves: write.lua's 'B' op.)

  KEYS[1]     store header hash
  ARGV[1]     the epoch of the store the caller holds (another creation of the store answers GONE)
  ARGV[2]     the new 'gb', ARGV[3] the new 'wb' (integers >= 0)

  Reply       {'OK'}; {'GONE'} when the store is deleted, a tombstone or another creation.
  Errors      'TDSTORE bad argument' for a base that is not an integer >= 0.
  Resending   the bases are absolute: a resend sets the same values. No reply cache is needed.
]]
local meta = KEYS[1]
local h = redis.call('HMGET', meta, 'epoch', 'version', 'state')
if h[1] ~= ARGV[1] or not h[2] or (h[3] and h[3] ~= 'ready') then
  return {'GONE'}
end
for k = 2, 3 do
  local v = ARGV[k]
  if not string.match(v or '', '^%d+$') or tonumber(v) > TDS_MAXINT then
    error('TDSTORE bad argument: marks base ' .. tostring(v))
  end
end
redis.call('HSET', meta, 'gb', ARGV[2], 'wb', ARGV[3])
return {'OK'}
