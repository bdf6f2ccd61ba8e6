--[[
  marks.lua: the counters a torchrl StoreStorage (tdstore/_torchrl_marks.py) keeps in a ring's
  header beside 'rw', so that every process reads the same values.

  'tr' counts in-place writes of rows through torchrl (rb[i] = td, set_at_, update_, torchrl's
  writers writing written slots): a SliceSampler caching episode boundaries in any process sees
  its revision move ('rw', 'tr' and the epoch are read together with one HMGET). 'gb' and 'wb'
  carry the generations and the write count across an emptying (the store is deleted and made
  again): a slot's torchrl generation is 'gb' plus its ring generation, so an (index, generation)
  handle taken before the emptying never looks live again, and rb.write_count is 'wb' + 'rw'.

  KEYS[1]     store header hash
  ARGV[1]     the epoch of the store the caller holds (another creation of the store answers GONE)
  ARGV[2]     'bump': 'tr' + 1; or 'base': ARGV[3] becomes 'gb' and ARGV[4] 'wb' (integers >= 0)

  Reply       {'OK', tr}; {'GONE'} when the store is deleted, a tombstone or another creation.
  Errors      'TDSTORE bad argument' for an unknown mode or a base that is not an integer >= 0;
              'TDSTORE damaged' when 'tr' is not an integer >= 0.
  Resending   a bump sent twice moves the revision twice (a revision only has to change); a base
              is absolute. No reply cache is needed.
]]
local meta = KEYS[1]
local h = redis.call('HMGET', meta, 'epoch', 'version', 'state', 'tr')
if h[1] ~= ARGV[1] or not h[2] or (h[3] and h[3] ~= 'ready') then
  return {'GONE'}
end
local tr = tds_int_field(h[4], 'tr', 0, TDS_MAXINT, 0)
local mode = ARGV[2]
if mode == 'bump' then
  return {'OK', redis.call('HINCRBY', meta, 'tr', 1)}
end
if mode ~= 'base' then
  error('TDSTORE bad argument: marks mode ' .. tostring(mode))
end
for k = 3, 4 do
  local v = ARGV[k]
  if not string.match(v or '', '^%d+$') or tonumber(v) > TDS_MAXINT then
    error('TDSTORE bad argument: marks base ' .. tostring(v))
  end
end
redis.call('HSET', meta, 'gb', ARGV[3], 'wb', ARGV[4])
return {'OK', tr}
