--[[
  sampling.lua: set a ring's sampling policy (priorities, rate limiter, queue), the header
  field 'sc' (JSON, see tdstore/_format/sampling_policy.py) that write.lua and read.lua enforce.

  Every change bumps the header's 'version' and 'kv', so a ring call planned from a header
  that does not know the new policy is answered STALE and planned again: no extend can
  skip the priority tree, no sample can skip the limiter.

  The client builds the new policy from the header it read, so the call checks that exact
  version; the script does what the change needs on the server.

  KEYS[1]     store header hash
  KEYS[2]     the priority tree (see _tree.lua)
  KEYS[3]     the times-sampled counts: 4 little-endian bytes per slot
  KEYS[4]     the store's reply cache (see tds_request in _lib.lua), with ARGV[5]
  ARGV[1]     '<epoch>:V<version>' the policy was built from (see tds_check in _lib.lua)
  ARGV[2]     the new policy (JSON, tdstore/_format/sampling_policy.py), '' for none
  ARGV[3]     what the change needs, space-separated words:
    (priorities turn on through tree_build.lua, which builds their tree in bounded steps)
    'limit'   a new rate limiter: inserts and samples count from now ('lb' = ring writes
              so far, 'sn' = 0)
    'queue'   queue mode turns on: the read cursor 'rr' starts at the oldest item a
              writer has not overwritten, unless items were popped before
  ARGV[4]     the store's Pub/Sub channel: waiting clients retry under the new policy
  ARGV[5]     optional: the change's request id. Checked before the version (a change bumps
              it, so its resend would be STALE): an id already recorded answers {'OK', header
              as it is now} and changes nothing; else the change is recorded under it.

  Reply       {'OK', header field, value, ...}: the header as the change left it (the
              client adopts it, no second round trip); {'STALE', header...}; {'GONE'}.
  Errors      'TDSTORE bad argument' for a malformed call; 'TDSTORE damaged' when 'count' or
              'rw' is out of range (see tds_ring_fields in _lib.lua).
]]
local meta = KEYS[1]
-- a resent change (its request id recorded, see tds_request): applied once, the header as it is now
local request = ARGV[5] and ARGV[5] ~= '' and tds_request(4, ARGV[5]) or nil
if request ~= nil and request.seen then
  local now = redis.call('HGETALL', meta)
  if #now == 0 then
    return {'GONE'}
  end
  table.insert(now, 1, 'OK')
  return now
end
local bad = tds_check(meta, ARGV[1], '')
if bad then
  return bad
end
local h = redis.call('HMGET', meta, 'count', 'rw', 'schema', 'kv')
local count, rw = tds_ring_fields(h[1], h[2])
rw = tds_ring_rw(meta, count, rw)
tds_int_field(h[4], 'kv', 0, TDS_MAXINT)  -- bumped below (version: tds_check compared it with the client's)
local needs = {}
for word in string.gmatch(ARGV[3], '%S+') do
  needs[word] = true
end
if needs.tree or needs.times then
  error('TDSTORE bad argument: priorities are built by tree_build.lua')
end
if ARGV[2] ~= '' and not pcall(cjson.decode, ARGV[2]) then  -- before anything is written
  error('TDSTORE bad argument: a sampling policy that is not JSON')
end
if needs.limit then
  redis.call('HSET', meta, 'lb', string.format('%.0f', rw), 'sn', '0')
end
if needs.queue and redis.call('HEXISTS', meta, 'rr') == 0 then
  redis.call('HSET', meta, 'rr', string.format('%.0f', math.max(0, rw - count)))
end
if ARGV[2] == '' then
  redis.call('HDEL', meta, 'sc')
else
  redis.call('HSET', meta, 'sc', ARGV[2])
end
redis.call('HINCRBY', meta, 'kv', 1)
redis.call('HINCRBY', meta, 'version', 1)
if ARGV[4] ~= nil and ARGV[4] ~= '' then
  redis.call('PUBLISH', ARGV[4], 'c')
end
-- the policy's keys expire with the store
local ttl = redis.call('PTTL', meta)
if ttl > 0 then
  tds_expire_keys(2, 3, ttl)
end
tds_remember(request, 'C')
local out = redis.call('HGETALL', meta)
table.insert(out, 1, 'OK')
return out
