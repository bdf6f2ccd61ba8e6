--[[
  copy.lua: copy a whole store to a new td_id, on the server (clone(recurse=True)).

  The bytes never leave the server: each key is copied with COPY (Redis 6.2+,
  Valkey, Dragonfly, KeyDB) inside one script, so the copy is a snapshot of the
  source at one instant, and the new store appears whole or not at all. The new
  header is the source's (schema, versions, ring counter) with a fresh epoch, as it
  is another store, and the copy keeps the source's time to live, if any.

  The source and the copy have different hash tags: on Redis Cluster they may
  live on different nodes, where a script cannot reach both (the client then
  copies through itself).

  KEYS[1]     source header hash
  KEYS[2]     new header hash
  KEYS[3]     registry set of the new store's prefix
  KEYS[4..]   source data / offset / shape keys, then the new store's keys in the
              same order (two halves of equal length)
  ARGV[1]     '<epoch>:V<version>' of the source, as the client listed its keys
  ARGV[2]     the new td_id (added to the registry)
  ARGV[3]     the new epoch

  Reply       {'OK', number of keys copied}; {'STALE', header...}; {'GONE'}.
  Errors      'TDSTORE exists' when the new header already exists (nothing copied).
]]
local src, dst = KEYS[1], KEYS[2]
local bad = tds_check(src, ARGV[1], '')
if bad then
  return bad
end
if redis.call('EXISTS', dst) == 1 then
  error('TDSTORE exists: a store with the new td_id already exists')
end
local half = (#KEYS - 3) / 2
local n = 0
for i = 4, 3 + half do
  local to = KEYS[i + half]
  redis.call('DEL', to)
  n = n + redis.call('COPY', KEYS[i], to)
end
redis.call('COPY', src, dst)
redis.call('HSET', dst, 'epoch', ARGV[3])
redis.call('PERSIST', dst)
redis.call('SADD', KEYS[3], ARGV[2])
local ttl = math.max(redis.call('PTTL', src), 0)
tds_expire_keys(4 + half, #KEYS, ttl)
tds_expire_keys(2, 2, ttl)
return {'OK', n + 1}
