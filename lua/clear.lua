--[[
  clear.lua: delete every key of one store, and nothing else; or one batch of them.

  The client lists the keys of every leaf number the store ever used (its header's
  'next' counter), so keys left by deleted leaves go too. The version check makes a
  client whose cache misses a newer leaf refresh first instead of leaving it behind.
  No pattern matching is used, so a prefix or td_id holding glob characters cannot
  reach another store.

  A store of more keys than one call may delete (tdstore/_engine/batches.py) is deleted in
  batches: the first batch turns the header into a tombstone (state 'deleting', no
  'version': every script answers GONE, see tds_lapsed in _lib.lua), the next ones
  delete keys under that tombstone, the last one the header and the registry entry.
  A client that dies half-way leaves a tombstone that create.lua, this script and
  'tdstore rm' finish deleting (its keys keep the store's time to live, if any).

  KEYS[1]     store header hash
  KEYS[2]     registry set of the prefix (the td_id is removed from it), unless ARGV[3]
              is 'noreg' (Redis Cluster: the registry lives in another slot and the
              client removes the entry itself)
  KEYS[3..]   every data / offset / shape key of the store (KEYS[2..] with 'noreg'), or
              this batch's
  ARGV[1]     '<epoch>:V<version>': the schema version the client listed the keys from
              (a header left half-done of that epoch is deleted as well: tds_lapsed);
              '<epoch>:X': a later batch, the header must be that epoch's tombstone or
              lapsed; or '*' to delete what is listed without any check (used to abort an
              upload, and by 'tdstore rm' for a store whose header is gone or unreadable)
  ARGV[2]     the td_id
  ARGV[3]     optional: 'noreg' when KEYS holds no registry ('' otherwise)
  ARGV[4]     optional: 'keep': not the last batch; the header stays, as a tombstone ('' otherwise)
  ARGV[5]     optional: the most bytes one call frees (freeing a value costs the server time in
              proportion to its size, ~0.5 ms per 4 MiB): once the keys deleted held that many,
              the call stops, leaving the header a tombstone, and says how far it got

  Reply       {'OK', number of keys deleted, number of listed data keys it went through (all of
              them, unless ARGV[5] stopped it: the header then stays, a tombstone)};
              {'STALE', header...}; {'GONE'}.
]]
local meta = KEYS[1]
local spec = ARGV[1]
local epoch = string.match(spec, '^(%x+):')
if string.match(spec, '^%x+:X$') then
  local have = redis.call('HGET', meta, 'epoch')
  if not have then
    return {'GONE'}
  end
  if have ~= epoch or not tds_lapsed(meta) then
    return tds_stale(meta)
  end
elseif spec ~= '*' and not (epoch and tds_lapsed(meta) and redis.call('HGET', meta, 'epoch') == epoch) then
  local bad = tds_check(meta, spec, '')
  if bad then
    return bad
  end
end
local first = 3
if ARGV[3] == 'noreg' then
  first = 2
end
local budget = tonumber(ARGV[5] or '')
local function tombstone()
  if redis.call('EXISTS', meta) == 1 and redis.call('HGET', meta, 'state') ~= 'deleting' then
    redis.call('HDEL', meta, 'version')
    redis.call('HSET', meta, 'state', 'deleting')
  end
end
if ARGV[4] == 'keep' then
  tombstone()
end
local n, bytes, upto = 0, 0, #KEYS
for i = first, #KEYS do
  if budget then
    local len = redis.pcall('STRLEN', KEYS[i])  -- a hash or zset (inventory, lease table): not counted
    if type(len) == 'number' then
      bytes = bytes + len
    end
  end
  n = n + redis.call('DEL', KEYS[i])
  if budget and bytes >= budget and i < #KEYS then
    upto = i
    break
  end
end
if upto < #KEYS then
  tombstone()
elseif ARGV[4] ~= 'keep' then
  n = n + redis.call('DEL', meta)
  if first == 3 then
    redis.call('SREM', KEYS[2], ARGV[2])
  end
end
return {'OK', n, upto - first + 1}
