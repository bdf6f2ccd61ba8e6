--[[
  commit.lua: publish a finished upload.

  from_lazy_stack writes a new store under a header in state 'uploading:<token>'
  with every key on a short TTL that each chunk renews, so an uploader that dies
  leaves no keys behind once the TTL runs out. This script checks that the upload
  is still the caller's, marks the store ready and removes every TTL (or sets the
  store's own, the same on every key), atomically: readers either see no store or
  the whole store.

  KEYS[1]     store header hash
  KEYS[2..]   every data / offset / shape key of the store
  ARGV[1]     the upload token
  ARGV[2]     the store's time to live in milliseconds, '0' for none
  ARGV[3]     optional: the deadline in Unix milliseconds that ARGV[2] stands for (a spread
              store: its segments on other nodes got the same one)

  Reply       {'OK'}; {'GONE'} when the header expired or was deleted meanwhile.
  Errors      'TDSTORE upload lost' when the header is not this upload's.
]]
local meta = KEYS[1]
local state = redis.call('HGET', meta, 'state')
if not state then
  return {'GONE'}
end
if state ~= 'uploading:' .. ARGV[1] then
  error('TDSTORE upload lost: the store header is not in this upload\'s state')
end
redis.call('HSET', meta, 'state', 'ready')
tds_expire_keys(1, #KEYS, tds_num(ARGV[2], 'ttl'), ARGV[3])
return {'OK'}
