--[[
  trajectories.lua: set which key tells a ring's trajectories apart (header field 'tj', see
  tdstore/_format/trajectories.py), and build its episode index (see _episodes.lua) over the rows
  the ring holds, from the runs the client found in them.

  The change bumps the header's 'version' and 'kv', so a ring write planned without knowing it is
  answered STALE and planned again, this time passing each row's id or end flag (write.lua 'J').
  The client read the key's values of the rows held at ring write count rw (ARGV[3]); a ring
  written since answers MOVED and nothing changes (the client reads again).

  KEYS[1]     store header hash
  KEYS[2]     the episode index (zset, P:{I}:j)
  ARGV[1]     '<epoch>:V<version>' the setting was built from (see tds_check in _lib.lua)
  ARGV[2]     the setting (JSON: {"by": "id" | "end", "key": [...]}), '' to forget it
  ARGV[3]     the ring write count the runs were read at
  ARGV[4]     the runs of the rows held, oldest first: pairs (first write number, length) as
              little-endian int64, covering max(0, rw - count) .. rw - 1 exactly ('' when ARGV[2] is)
  ARGV[5]     the newest row's 'jv' (see _episodes.lua): its id as 16 hex digits, or '0' / '1'

  Reply       {'OK', header field, value, ...}: the header as the change left it;
              {'WAIT', 'moved', rw}: the ring was written since the runs were read (nothing changed);
              {'STALE', header...}; {'GONE'}.
  Errors      'TDSTORE bad argument' for a malformed call (runs that do not cover the rows held,
              a setting that is not JSON); 'TDSTORE damaged' when 'count' or 'rw' is out of range.
              Cost: one ZADD per run (a ring of 10^6 rows in episodes of 100: 10^4 runs, a few ms).
]]
local meta = KEYS[1]
local zkey = KEYS[2]
local bad = tds_check(meta, ARGV[1], '')
if bad then
  return bad
end
local h = redis.call('HMGET', meta, 'count', 'rw')
local count, rw = tds_ring_fields(h[1], h[2])
rw = tds_ring_rw(meta, count, rw)
if rw ~= tds_num(ARGV[3], 'ring write count') then
  return {'WAIT', 'moved', string.format('%.0f', rw)}
end
if ARGV[2] ~= '' then
  local ok, setting = pcall(cjson.decode, ARGV[2])
  if not ok or type(setting) ~= 'table' or (setting.by ~= 'id' and setting.by ~= 'end') then
    error('TDSTORE bad argument: a trajectory setting that is not {"by": "id" | "end", "key": [...]}')
  end
end
local runs = ARGV[4]
if #runs % 16 ~= 0 then
  error('TDSTORE bad argument: run table size')
end
local n = #runs / 16
local at = math.max(0, rw - count)
local members = {}
for j = 1, n do
  local start, len = tds_u64(runs, 16 * j - 15), tds_u64(runs, 16 * j - 7)
  if start ~= at or len < 1 then
    error('TDSTORE bad argument: the runs do not cover the rows the ring holds')
  end
  members[j] = {len, tds_ep_fmt(start)}
  at = start + len
end
if ARGV[2] ~= '' and (at ~= rw or (n > 0 and ARGV[5] == '')) then
  error('TDSTORE bad argument: the runs do not cover the rows the ring holds')
end
redis.call('DEL', zkey)
redis.call('HDEL', meta, 'jf', 'jl', 'jv', 'jx')
if ARGV[2] == '' then
  redis.call('HDEL', meta, 'tj')
else
  for j = 1, n, 256 do
    local args = {}
    for k = j, math.min(n, j + 255) do
      args[#args + 1] = members[k][1]
      args[#args + 1] = members[k][2]
    end
    redis.call('ZADD', zkey, unpack(args))
  end
  if n > 0 then
    redis.call('HSET', meta, 'jf', members[1][2], 'jl', members[n][2], 'jv', ARGV[5])
  end
  redis.call('HSET', meta, 'tj', ARGV[2])
  local ttl = redis.call('PTTL', meta)
  if ttl > 0 and n > 0 then
    redis.call('PEXPIRE', zkey, ttl)
  end
end
redis.call('HINCRBY', meta, 'kv', 1)
redis.call('HINCRBY', meta, 'version', 1)
local out = redis.call('HGETALL', meta)
table.insert(out, 1, 'OK')
return out
