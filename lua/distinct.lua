--[[
  distinct.lua: turn a ring's distinct-row tracking on or off (lua/README.md "Stats"): the header
  field 'sd' ('1' when on, absent when off) that _seen.lua and sampled.lua read on the server.

  Off by default: the sampled-rows bitmap costs a BITFIELD per counted sample (and a script call per
  full ring's transaction sample), too much for the hot path. A change bumps the header's 'version'
  and 'kv', so a full ring's transaction sample planned from a header that does not know it is refused
  by its 'kv' guard and planned again (the scripts read 'sd' themselves). Turning it on starts an empty
  bitmap and zeroes 'ovs'/'ovu': rows are counted from then on; turning it off deletes both.
  Asking for the state the ring is in changes nothing (so a resent call is harmless).

  KEYS[1]     store header hash
  KEYS[2]     the store's stats hash (StoreKeys.stats)
  KEYS[3]     the store's sampled-rows bitmap (StoreKeys.sampled_rows)
  ARGV[1]     '<epoch>:*' (see tds_check in _lib.lua)
  ARGV[2]     '1' on, '0' off

  Reply       {'OK', header field, value, ...}: the header as the call left it (the client adopts it);
              {'STALE', header...}; {'GONE'}.
  Errors      'TDSTORE bad argument' when ARGV[2] is not '0' or '1'.
]]
local meta, hash, bits = KEYS[1], KEYS[2], KEYS[3]
local on = ARGV[2]
if on ~= '0' and on ~= '1' then
  error('TDSTORE bad argument: distinct tracking ' .. tostring(on) .. ' (0 or 1)')
end
local bad = tds_check(meta, ARGV[1], '')
if bad then
  return bad
end
local was = redis.call('HGET', meta, 'sd') == '1'
if was ~= (on == '1') then
  redis.call('DEL', bits)
  redis.call('HDEL', hash, 'ovs', 'ovu')
  if on == '1' then
    redis.call('HSET', meta, 'sd', '1')
  else
    redis.call('HDEL', meta, 'sd')
  end
  redis.call('HINCRBY', meta, 'kv', 1)
  redis.call('HINCRBY', meta, 'version', 1)
end
local out = redis.call('HGETALL', meta)
table.insert(out, 1, 'OK')
return out
