--[[
  lock.lua: the schema lock of a spread store (segments on several Redis Cluster nodes).

  A schema change of a spread store cannot be one script: it prepares every segment
  (on its own node) before it commits the header. The lock makes such changes take
  turns, and its lease lets another client finish the work of one that died: a lock
  whose lease ran out is taken over, and the new holder learns the dead holder's
  token and the leaf numbers it may have left data under, to roll those back.
  Time is the header node's clock only (TIME), so clocks of other nodes never matter.
  The commit (write.lua with '<epoch>:V<n>@<token>') checks that the lock is still held;
  the holder releases it after its clean-up. When a client was held off by the change
  (it asked for the lock to undo a dead changer's work and found it busy), the lock
  stays free of changers for a quiet period after the release: that client then gets
  its call through before the next change prepares the segments again, so a process
  that changes the schema in a loop cannot starve the others.

  KEYS[1]     store header hash
  ARGV[1]     'acquire' or 'release'
  acquire:
    ARGV[2]   '<epoch>:V<version>': the schema version the change was planned from
    ARGV[3]   token (digits) of the caller
    ARGV[4]   lease in milliseconds
    ARGV[5]   the header's 'next' leaf number after the change (leaves below it may get data)
    ARGV[6]   the number of segments after the change (its guards may have moved)
    ARGV[7]   quiet period in milliseconds: the lock is refused (BUSY) that long after a
              release that followed a held-off client
    ARGV[8]   '1' when the caller is a client held off by a change (a BUSY reply then
              records it, field 'lkw'), else '0'
  release:
    ARGV[2]   token: the lock is removed only while that token holds it

  Reply       acquire: {'OK'} (free) or {'OK', dead token, dead next, dead segments} (an
              expired lock taken over: the new holder inherits its next and segments); {'BUSY', milliseconds left}; {'STALE', header...}; {'GONE'}.
              release: {'OK', 1 or 0 (removed or not held by the token)}; a release
              after a held-off client records its time in the field 'lkd' (the quiet
              period starts there).
  Errors      'TDSTORE bad argument' for an unknown mode or a token that is not digits;
              'TDSTORE damaged' when 'lkx', 'lkn', 'lks' or 'lkd' is not an integer >= 0.
]]
local meta = KEYS[1]
local mode = ARGV[1]
local now = redis.call('TIME')
local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
if mode == 'release' then
  if redis.call('HGET', meta, 'lk') == ARGV[2] then
    if redis.call('HGET', meta, 'lkw') then
      redis.call('HSET', meta, 'lkd', string.format('%.0f', ms))
    else
      redis.call('HDEL', meta, 'lkd')
    end
    redis.call('HDEL', meta, 'lk', 'lkx', 'lkn', 'lks', 'lkw')
    return {'OK', 1}
  end
  return {'OK', 0}
end
if mode ~= 'acquire' then
  error('TDSTORE bad argument: lock mode ' .. tostring(mode))
end
local token = ARGV[3]
if not string.match(token, '^%d+$') then
  error('TDSTORE bad argument: lock token ' .. token)
end
local bad = tds_check(meta, ARGV[2], '')
if bad then
  return bad
end
local held = redis.call('HMGET', meta, 'lk', 'lkx', 'lkn', 'lks', 'lkd')
local reply = {'OK'}
local nxt, segs = tds_num(ARGV[5], 'next leaf'), tds_num(ARGV[6], 'segments')
if held[1] then
  local left = tds_int_field(held[2], 'lkx', 0, TDS_MAXINT, 0) - ms
  if left > 0 then
    if ARGV[8] == '1' then
      redis.call('HSET', meta, 'lkw', '1')
    end
    return {'BUSY', string.format('%.0f', left)}
  end
  -- what the dead holder may have touched stays to be undone, by us or a later holder
  nxt = math.max(nxt, tds_int_field(held[3], 'lkn', 0, TDS_MAXINT, 0))
  segs = math.max(segs, tds_int_field(held[4], 'lks', 0, TDS_MAXINT, 0))
  reply = {'OK', held[1], string.format('%.0f', nxt), string.format('%.0f', segs)}
elseif held[5] then
  local left = tds_int_field(held[5], 'lkd', 0, TDS_MAXINT) + tds_num(ARGV[7] or '0', 'quiet period') - ms
  if left > 0 then
    return {'BUSY', string.format('%.0f', left)}
  end
end
redis.call('HSET', meta, 'lk', token, 'lkx', string.format('%.0f', ms + tds_num(ARGV[4], 'lease')), 'lkn', string.format('%.0f', nxt), 'lks', string.format('%.0f', segs))
return reply
