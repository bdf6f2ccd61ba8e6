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
  KEYS[4..]   the source's inventory, data, offset and shape keys, then the new store's
              keys in the same order (two halves of equal length); the copy's inventory
              lists the copy's keys that the source's lists
  ARGV[1]     '<epoch>:V<version>' of the source, as the client listed its keys
  ARGV[2]     the new td_id (added to the registry)
  ARGV[3]     the new epoch
  ARGV[4]     optional: the most bytes one call copies (the server holds everything meanwhile;
              a store larger than that is refused, see lua/README.md "Whole-store calls in
              batches"); the client also refuses stores of more keys than one call may name

  Reply       {'OK', number of keys copied}; {'STALE', header...}; {'GONE'}. A resend after a
              lost reply (the new header exists with ARGV[3]'s epoch) answers OK with the keys
              the copy holds, copying nothing again.
  Errors      'TDSTORE exists' when the new header already exists, of another epoch (nothing copied);
              'TDSTORE refused' when the store holds more than ARGV[4] bytes (nothing copied).
]]
local src, dst = KEYS[1], KEYS[2]
local half = (#KEYS - 3) / 2
local bad = tds_check(src, ARGV[1], '')
if bad then
  return bad
end
if redis.call('EXISTS', dst) == 1 then
  if redis.call('HGET', dst, 'epoch') == ARGV[3] then
    -- this call's own copy (the epoch is the call's, made fresh for it): a resend after a lost reply
    local n = 1
    for i = 5 + half, #KEYS do
      n = n + redis.call('EXISTS', KEYS[i])
    end
    return {'OK', n}
  end
  error('TDSTORE exists: a store with the new td_id already exists')
end
local most = tonumber(ARGV[4] or '')
if most then
  local bytes = 0
  for i = 5, 3 + half do
    local len = redis.pcall('STRLEN', KEYS[i])  -- a hash or zset key (the lease table) is no string: not counted
    if type(len) == 'number' then
      bytes = bytes + len
    end
  end
  if bytes > most then
    error(string.format('TDSTORE refused: a server-side clone() copies at most %.0f bytes in one call, and this store holds %.0f; ' ..
      'copy it in chunks with tdstore.export_checkpoint(store, path) and tdstore.import_checkpoint(path, ...) instead', most, bytes))
  end
end
local n = 0
-- KEYS[4] and KEYS[4 + half] are the inventories (see _lib.lua): the copy's lists its own key names
local inv, inv_to = KEYS[4], KEYS[4 + half]
redis.call('DEL', inv_to)
for i = 5, 3 + half do
  local to = KEYS[i + half]
  redis.call('DEL', to)
  n = n + redis.call('COPY', KEYS[i], to)
  if redis.call('HEXISTS', inv, KEYS[i]) == 1 then
    redis.call('HSET', inv_to, to, '1')
  end
end
redis.call('COPY', src, dst)
redis.call('HSET', dst, 'epoch', ARGV[3])
redis.call('HDEL', dst, 'xd')  -- the copy's keys all get one deadline below: no expire of the source's in progress
redis.call('PERSIST', dst)
redis.call('SADD', KEYS[3], ARGV[2])
local ttl = math.max(redis.call('PTTL', src), 0)
tds_expire_keys(4 + half, #KEYS, ttl)
tds_expire_keys(2, 2, ttl)
return {'OK', n + 1}
