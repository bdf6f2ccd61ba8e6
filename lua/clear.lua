--[[
  clear.lua: delete every key of one store, and nothing else.

  The client lists the keys of every leaf number the store ever used (its header's
  'next' counter), so keys left by deleted leaves go too. The version check makes a
  client whose cache misses a newer leaf refresh first instead of leaving it behind.
  No pattern matching is used, so a prefix or td_id holding glob characters cannot
  reach another store.

  KEYS[1]     store header hash
  KEYS[2]     registry set of the prefix (the td_id is removed from it), unless ARGV[3]
              is 'noreg' (Redis Cluster: the registry lives in another slot and the
              client removes the entry itself)
  KEYS[3..]   every data / offset / shape key of the store (KEYS[2..] with 'noreg')
  ARGV[1]     '<epoch>:V<version>': the schema version the client listed the keys from, or
              '*' to delete what is listed without any check (used to abort an upload,
              and by 'tdstore rm' for a store whose header is gone or unreadable)
  ARGV[2]     the td_id
  ARGV[3]     optional: 'noreg' when KEYS holds no registry

  Reply       {'OK', number of keys deleted}; {'STALE', header...}; {'GONE'}.
]]
local meta = KEYS[1]
if ARGV[1] ~= '*' then
  local bad = tds_check(meta, ARGV[1], '')
  if bad then
    return bad
  end
end
local n = redis.call('DEL', meta)
local first = 3
if ARGV[3] == 'noreg' then
  first = 2
else
  redis.call('SREM', KEYS[2], ARGV[2])
end
for i = first, #KEYS do
  n = n + redis.call('DEL', KEYS[i])
end
return {'OK', n}
