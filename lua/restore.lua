--[[
  restore.lua: give a store restored from a checkpoint (tdstore/_checkpoint/export_import.py) its ring and
  sampling state, in one step: the ring write count and the policy counters in the header,
  the policy itself ('sc'), and the priority tree and sample counts, which the client has
  written beforehand into staging keys (plain SETRANGEs, a short time to live) and which
  are moved into place here (RENAME: O(1), whatever the ring's size).

  The store was just uploaded by the same client (commit.lua), so the call checks the exact
  version it was committed at: nobody else has changed it meanwhile, or nothing is written.
  Like sampling.lua, it bumps 'version' and 'kv', so that a handle that planned a ring call
  before the restore plans again, and publishes on the store's channel.

  KEYS[1]     store header hash
  KEYS[2]     the priority tree (see _tree.lua)
  KEYS[3]     the times-sampled counts: 4 little-endian bytes per slot
  KEYS[4]     the staged priority tree (moved onto KEYS[2] when ARGV[4] is not '0')
  KEYS[5]     the staged sample counts (moved onto KEYS[3] when ARGV[5] is not '0')
  KEYS[6]     optional: the store's stats hash (see tds_stat in _lib.lua), with ARGV[7]
  ARGV[1]     '<epoch>:V<version>' the store was committed at (see tds_check in _lib.lua)
  ARGV[2]     header fields, space-separated 'name=value' words, among rw, pm, lb, sn, rr, ho;
              each value a number (pm a float, the others integers >= 0); 'ho': the oldest
              ring write whose row the checkpoint holds (older ones absent, see _absent.lua)
  ARGV[3]     the sampling policy (JSON, tdstore/_format/sampling_policy.py), '' for none
  ARGV[4]     the priority tree's byte length (the staged key must hold exactly that), '0' for none
  ARGV[5]     the sample counts' byte length (likewise), '0' for none
  ARGV[6]     the store's Pub/Sub channel
  ARGV[7]     optional: the stats counters the checkpoint carries, space-separated 'name=value'
              words (a name of letters, digits and '_', an integer >= 0), set as KEYS[6]

  Reply       {'OK', header field, value, ...}: the header as the restore left it;
              {'STALE', header...}; {'GONE'}.
  Errors      'TDSTORE bad argument' for a malformed call or a staged key of the wrong length;
              'TDSTORE damaged' for a field out of range (nothing written either way).
]]
local meta = KEYS[1]
local bad = tds_check(meta, ARGV[1], '')
if bad then
  return bad
end
local allowed = {rw = true, pm = true, lb = true, sn = true, rr = true, ho = true}
local fields, seen = {}, {}
for name, value in string.gmatch(ARGV[2], '(%w+)=(%S+)') do
  if not allowed[name] or seen[name] then
    error('TDSTORE bad argument: header field ' .. name .. '=' .. value)
  end
  seen[name] = true
  -- the ranges the other scripts read them with (tds_int_field, tds_float_field in _lib.lua)
  if name == 'pm' then
    tds_float_field(value, name, 0, 1e300)
  else
    tds_int_field(value, name, 0, TDS_MAXINT)
  end
  fields[#fields + 1] = name
  fields[#fields + 1] = value
end
local counters = {}
for name, value in string.gmatch(ARGV[7] or '', '(%S+)=(%S+)') do
  if not string.match(name, '^[%w_]+$') or #name > 64 then
    error('TDSTORE bad argument: stats field ' .. name)
  end
  tds_int_field(value, name, 0, TDS_MAXINT)
  counters[#counters + 1] = name
  counters[#counters + 1] = value
end
if #counters > 0 and KEYS[6] == nil then
  error('TDSTORE bad argument: stats without their key')
end
tds_int_field(redis.call('HGET', meta, 'kv'), 'kv', 0, TDS_MAXINT)  -- bumped below
local function staged(src, want)
  local n = tds_num(want, 'length')
  if n > 0 and redis.call('STRLEN', src) ~= n then
    error('TDSTORE bad argument: a staged key holds ' .. redis.call('STRLEN', src) .. ' bytes, not ' .. n)
  end
  return n
end
local tree_len = staged(KEYS[4], ARGV[4])
local times_len = staged(KEYS[5], ARGV[5])
if ARGV[3] ~= '' then
  cjson.decode(ARGV[3])  -- a malformed policy is refused before anything is written
end
-- every check passed: write
redis.call('HDEL', meta, 'rw', 'pm', 'lb', 'sn', 'rr', 'ho')
if #fields > 0 then
  redis.call('HSET', meta, unpack(fields))
end
if ARGV[3] == '' then
  redis.call('HDEL', meta, 'sc')
else
  redis.call('HSET', meta, 'sc', ARGV[3])
end
redis.call('DEL', KEYS[2], KEYS[3])
if tree_len > 0 then
  redis.call('RENAME', KEYS[4], KEYS[2])
end
if times_len > 0 then
  redis.call('RENAME', KEYS[5], KEYS[3])
end
redis.call('HINCRBY', meta, 'kv', 1)
redis.call('HINCRBY', meta, 'version', 1)
-- the policy's keys expire with the store (the staged keys' own short time to live goes)
local ttl = redis.call('PTTL', meta)
tds_expire_keys(2, 3, ttl > 0 and ttl or 0)
if #counters > 0 then
  redis.call('DEL', KEYS[6])
  redis.call('HSET', KEYS[6], unpack(counters))
  tds_expire_keys(6, 6, ttl > 0 and ttl or 0)
end
if ARGV[6] ~= nil and ARGV[6] ~= '' then
  redis.call('PUBLISH', ARGV[6], 'c')
end
local out = redis.call('HGETALL', meta)
table.insert(out, 1, 'OK')
return out
