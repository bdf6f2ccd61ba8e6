--[[
  create.lua: create a store header, or report the one that already exists.

  The constructor calls it with the header it wants. It never overwrites an
  existing header (other handles rely on it): when the store exists, the client
  gets the stored header back in the same round trip and attaches to it, or raises
  when count, stack dim or inner batch size disagree.

  A new store is added to the registry of its prefix (a set of td_ids), so that
  stores can be listed without knowing their ids; 'tdstore ls' reads each
  listed header for the rest, so the registry never holds facts that go stale.

  KEYS[1]     store header hash
  KEYS[2]     registry set of the prefix; absent on Redis Cluster, where it lives in
              another slot and the client adds the entry itself
  ARGV[1]     time to live of the header in milliseconds, '0' for none (an upload
              creates its header with a TTL, so an uploader that dies leaves nothing;
              a store made with ttl= gets its TTL here)
  ARGV[2]     the td_id, as added to the registry
  ARGV[3..]   field, value, field, value, ... of the new header

  Reply       {'OK'} when the header was created;
              {'EXISTS', field, value, ...} with the stored header otherwise;
              {'LAPSED', field, value, ...} when that header is what a whole-store call cut in
              batches left half-done (a tombstone or a lapsed deadline: tds_lapsed in _lib.lua):
              the client deletes what is left (clear.lua) and creates again.
  Errors      'TDSTORE bad argument' when the field list is odd; WRONGTYPE when the header or the
              registry holds another type (set by hand), before anything is written.
]]
local meta = KEYS[1]
if redis.call('EXISTS', meta) == 1 then
  local r = redis.call('HGETALL', meta)
  table.insert(r, 1, tds_lapsed(meta) and 'LAPSED' or 'EXISTS')
  return r
end
if (#ARGV - 2) % 2 ~= 0 or #ARGV < 4 then
  error('TDSTORE bad argument: header fields must come in pairs')
end
local ttl = tds_num(ARGV[1], 'ttl')
if KEYS[2] then  -- first: a registry of another type (WRONGTYPE, set by hand) fails the call before the header is written
  redis.call('SADD', KEYS[2], ARGV[2])
end
for i = 3, #ARGV, 2 do
  redis.call('HSET', meta, ARGV[i], ARGV[i + 1])
end
if ttl > 0 then
  redis.call('PEXPIRE', meta, ttl)
end
return {'OK'}
