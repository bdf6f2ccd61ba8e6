--[[
  commit.lua: publish a finished upload.

  from_lazy_stack writes a new store under a header in state 'uploading:<token>'
  with every key on a short TTL that each chunk renews, so an uploader that dies
  leaves no keys behind once the TTL runs out. This script checks that the upload
  is still the caller's, marks the store ready and removes every TTL (or sets the
  store's own, the same on every key), atomically: readers either see no store or
  the whole store. The store becomes a full ring: its ring write count 'rw' is set to
  its count (every slot written once).

  The upload's keys carry a TTL until now, so a server with a volatile-* maxmemory-policy may
  have evicted some: every key is checked against the length the header implies (as
  write.lua checks the keys it writes in place, see _lib.lua) before the store is published,
  and a store that keeps an inventory (header field 'na') gets every key listed in it.

  A store of more keys than one call may touch (tdstore/_engine/batches.py) is committed in batches of
  keys, each checked, listed and given the store's deadline, under the one deadline the first
  batch read and returned; the header's state turns 'ready' in the last batch only, so readers
  still see no store or the whole store. The first batch gives the header the later of the
  upload's deadline and the store's and records the earlier in 'xd' (tds_ttl_begin in
  _lib.lua): an uploader dying half-way leaves an uploading header that outlives every key and,
  once 'xd' passes, counts as gone (create.lua and 'tdstore rm' delete what is left).

  KEYS[1]     store header hash
  KEYS[2]     the store's inventory hash when the header has the field 'na' (see _lib.lua)
  KEYS[2..]   every data / offset / shape key of the store
  ARGV[1]     the upload token
  ARGV[2]     the store's time to live in milliseconds, '0' for none
  ARGV[3]     the deadline in Unix milliseconds that ARGV[2] stands for (a spread store: its
              segments on other nodes got the same one), or ''
  ARGV[4]     what each key holds, as write.lua's ARGV[6] (tdstore/_format/integrity.py)
  ARGV[5]     optional: the phase of a commit cut in batches: 'first', 'next' or 'last' (KEYS
              then hold the header, the inventory, and this batch's keys)

  Reply       {'OK', deadline (Unix ms, '' for none)}; {'GONE'} when the header expired or was
              deleted meanwhile, or a batch found it lapsed (its keys may have expired).
  Errors      'TDSTORE upload lost' when the header is not this upload's;
              'TDSTORE damaged' when a key of the upload is missing or short (nothing changed).
]]
local meta = KEYS[1]
local state = redis.call('HGET', meta, 'state')
if not state or (redis.call('HEXISTS', meta, 'xd') == 1 and tds_lapsed(meta)) then
  return {'GONE'}
end
if state ~= 'uploading:' .. ARGV[1] then
  error('TDSTORE upload lost: the store header is not in this upload\'s state')
end
local checks = ARGV[4] or ''
local present = {}
for i = 2, #KEYS do
  local code, want, aux = tds_expected(checks, i)
  if code ~= nil and code ~= 0 then
    local have = redis.call('STRLEN', KEYS[i])
    if code == 1 then
      local okey = KEYS[aux]
      local olen = redis.call('STRLEN', okey)
      local last = tds_last_offset(olen, function(from, to) return redis.call('GETRANGE', okey, from, to) end)
      if have < last then
        tds_short(KEYS[i], have, last, true)
      end
    elseif have ~= want then
      tds_short(KEYS[i], have, want, false)
    end
    if redis.call('EXISTS', KEYS[i]) == 1 then
      present[#present + 1] = KEYS[i]
    end
  end
end
local inv = tds_inventory(meta)
for _, k in ipairs(present) do
  tds_record(meta, inv, k)
end
local deadline = tds_deadline(tds_num(ARGV[2], 'ttl'), ARGV[3])
local phase = ARGV[5] or ''
if phase ~= '' then
  if phase == 'first' then
    tds_ttl_begin(meta, deadline)
  end
  tds_expire_at(2, #KEYS, deadline)
  if phase ~= 'last' then
    return {'OK', deadline and string.format('%.0f', deadline) or ''}
  end
  tds_ttl_end(meta, deadline)
end
redis.call('HSET', meta, 'state', 'ready')
-- an uploaded store is a full ring of count written slots (generation 1 each): its first
-- extend overwrites slot 0, the oldest (lua/README.md, "The ring keeps one counter per store")
if redis.call('HEXISTS', meta, 'rw') == 0 then
  redis.call('HSET', meta, 'rw', string.format('%.0f', tds_num(redis.call('HGET', meta, 'count'), 'count')))
end
if phase == '' then
  tds_expire_at(1, #KEYS, deadline)
end
return {'OK', deadline and string.format('%.0f', deadline) or ''}
