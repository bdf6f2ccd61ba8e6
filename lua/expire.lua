--[[
  expire.lua: give every key of a store the same time to live, or remove it.

  All keys get the same deadline in one atomic step (time stands still inside a
  script), so a store never expires in part: a reader sees the whole store or
  none of it. Keys the store creates later (new leaves) take the header's TTL in
  write.lua. The version check makes a client whose cache misses a newer leaf
  refresh first, so no key is left without the deadline.

  KEYS[1]     store header hash
  KEYS[2..]   every data / offset / shape key of the store
  ARGV[1]     '<epoch>:V<version>': the schema version the client listed the keys from
  ARGV[2]     time to live in milliseconds; '0' removes it (PERSIST)
  ARGV[3]     optional: the deadline in Unix milliseconds that ARGV[2] stands for (a spread
              store: every segment, on whichever node, gets the same one)

  Reply       {'OK'}; {'STALE', header...}; {'GONE'}.
  Errors      'TDSTORE bad argument' when ARGV[2] is not a number.
]]
local meta = KEYS[1]
local bad = tds_check(meta, ARGV[1], '')
if bad then
  return bad
end
tds_expire_keys(1, #KEYS, tds_num(ARGV[2], 'ttl'), ARGV[3])
return {'OK'}
