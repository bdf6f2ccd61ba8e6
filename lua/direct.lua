--[[
  direct.lua: the two ends of a ring write whose rows travel as plain SETRANGEs
  (tdstore/_ring/direct_extend.py). A row argument of a script costs the server about 1.2 us per KiB
  to become a Lua string (a 500-row extend of 150 KB: 0.2 ms, against 5 us for SETRANGE),
  so the client sends, in one round trip:

      MULTI
      EVALSHA direct 'open' ...         check, reserve, account: each data key K moves to K:w
      SETRANGE K:w offset rows ...      the rows, at the slots the client expects
      EVALSHA direct 'close' ...        K:w moves back to K
      EXEC

  Everything runs inside one EXEC: no other client sees a key moved, or a row without its
  cursor. 'open' does all the write's bookkeeping (the ring cursor, the request's record, the
  channel's message, a new schema) and moves every key or none, its checks all first; it marks
  the header (field 'dw', the request id) only when it went through, and 'close' moves the keys
  back only under that mark, which it removes: a refused, failed or missing 'open' never lets
  'close' touch a data key. When 'open' refuses (stale schema, another writer moved the cursor,
  a key lost, a sampling policy, a resent request), it makes each K:w a hash instead: the
  SETRANGEs fail on it (WRONGTYPE) and write nothing, and 'close' deletes it. When 'open' raises,
  the SETRANGEs create K:w, which 'close' deletes. The data keys are never the SETRANGEs'
  targets, so a transaction whose scripts the server does not know (NOSCRIPT: both ends are this
  one script) writes only to the K:w names, which nothing reads; the client deletes them and
  sends the write through write.lua.

  The first write of a ring made empty goes this way too: 'open' takes the schema its rows
  create (checked against the exact version, as write.lua does) and allocates each data key the
  inventory says was never allocated (zeros, as write.lua would, with the header's deadline).

  KEYS[1]     store header hash
  KEYS[2]     the store's inventory hash (see _lib.lua; unused when the header has no 'na')
  KEYS[3]     the store's reply cache (see tds_request in _lib.lua)
  KEYS[4..]   pairs: a data key K the rows go to, then K:w
  KEYS[last]  optional, after the pairs: the store's stats hash, where 'open' counts the rows it
              lets in ('ins', see tds_stat in _lib.lua), then optional: the sampled-rows bitmap,
              where it clears the bits of the rows it overwrites, counted ('ovs', 'ovu': _seen.lua)

  ARGV[1]     'open' or 'close'
  ARGV[2]     the request id of the write (hex, see tds_request)
  close only:
  ARGV[3]     optional: the number of pairs (without it: as many as fit, an odd KEYS[last] the stats hash)
  open only:
  ARGV[3]     the ring write counter 'rw' the client expects (the rows' slots follow from it)
  ARGV[4]     rows
  ARGV[5]     '<epoch>:K<key-set version>', or '<epoch>:V<version>' with a new schema (see tds_check)
  ARGV[6]     'number:version' of every leaf written (see tds_check)
  ARGV[7]     the new schema JSON, or '' to keep the schema (write.lua's ARGV[3])
  ARGV[8]     with a new schema: the guard fields it sets (write.lua's ARGV[4])
  ARGV[9]     the Pub/Sub channel to publish 'w' on ('' for none)
  ARGV[10..]  per pair of KEYS, the bytes its data key holds (count * row bytes)

  Reply       open: {'GO', version, rw before} (the rows go in), {'DONE', version, rw before}
              for a request recorded by an earlier attempt (nothing written), {'MOVED', rw}
              when the cursor is elsewhere, {'SCRIPT'} when write.lua must do it (a sampling
              policy, a key not as long as expected that is not a key never allocated: write.lua
              names it lost), {'GONE'} or {'STALE', header...}.
              close: {'OK'} when the rows went in, else {'NO'}.
  Errors      'TDSTORE bad argument' for malformed arguments; a header field out of range
              raises as in write.lua; 'TDSTORE out of memory' as in write.lua when the keys
              to allocate would take the server past its maxmemory (the rows the
              transaction's SETRANGEs carry, freed at its end, are not counted: tds_room).
]]
local meta = KEYS[1]
local mode = ARGV[1]
if #KEYS < 5 then
  error('TDSTORE bad argument: direct.lua takes the header, the inventory, the reply cache, then pairs of keys')
end
-- the last key of a pair: the pairs counted by the sizes ('open') or ARGV[3] ('close'), else all but an odd last
local pairs_n = tonumber(mode == 'open' and #ARGV - 9 or ARGV[3])
local last = pairs_n and 3 + 2 * pairs_n or #KEYS - (#KEYS % 2 == 0 and 1 or 0)
if last > #KEYS or last < 5 then
  error('TDSTORE bad argument: direct.lua pairs of keys')
end

if mode == 'close' then
  -- 'open' went through only if it left its mark, this request's id; else each K:w goes
  -- (refused: a hash; 'open' raised or was never run: made by the SETRANGEs, zeros and rows)
  if redis.call('HGET', meta, 'dw') ~= ARGV[2] then
    for i = 5, last, 2 do
      redis.call('DEL', KEYS[i])
    end
    return {'NO'}
  end
  redis.call('HDEL', meta, 'dw')
  for i = 4, last, 2 do
    redis.call('RENAME', KEYS[i + 1], KEYS[i])
  end
  return {'OK'}
elseif mode ~= 'open' then
  error('TDSTORE bad argument: direct.lua mode ' .. tostring(mode))
end
-- tds:rest
-- (the helpers 'open' uses are made here: 'close' needs none, see tdstore/_engine/script_text.py)

local rw_want, n = tds_num(ARGV[3], 'ring write counter'), tds_num(ARGV[4], 'row count')
local function refuse(reply)
  for i = 5, last, 2 do
    redis.call('DEL', KEYS[i])
    redis.call('HSET', KEYS[i], 'refused', '1')  -- the SETRANGEs fail on a hash: nothing written
  end
  return reply
end
local request = tds_request(3, ARGV[2])
if request.seen then
  local version = redis.call('HGET', meta, 'version')
  if not version then
    return refuse({'GONE'})
  end
  return refuse({'DONE', version, string.sub(request.seen, 2)})
end
local schema = ARGV[7]
if schema ~= '' and not string.find(ARGV[5], ':V', 1, true) then
  error('TDSTORE bad argument: a schema change must check the exact version')
end
local bad, version = tds_check(meta, ARGV[5], ARGV[6])
if bad then
  return refuse(bad)
end
local head = redis.call('HMGET', meta, 'count', 'rw', 'sc', 'tj')
local count, rw = tds_ring_fields(head[1], head[2])
if head[3] or head[4] or n < 1 or n > count then  -- a policy or an episode index to keep: write.lua's
  return refuse({'SCRIPT'})
end
rw = tds_ring_rw(meta, count, rw)  -- a store filled by index is a full ring
if rw ~= rw_want then
  return refuse({'MOVED', string.format('%.0f', rw)})
end
-- each data key holds what the header implies, or was never allocated (allocated here)
local fresh, allocated, rows_bytes = {}, 0, 0
for i = 4, last, 2 do
  local size = tds_num(ARGV[10 + (i - 4) / 2], 'key size')
  rows_bytes = rows_bytes + math.floor(size / count) * n  -- the rows this transaction's SETRANGEs carry
  local have = redis.call('STRLEN', KEYS[i])
  if have ~= size then
    if have ~= 0 or size < 1 or not tds_unallocated(meta, KEYS[i]) then
      return refuse({'SCRIPT'})  -- write.lua names the key lost or short
    end
    fresh[i] = size
    allocated = allocated + size
  end
end
if allocated > 0 then
  tds_room(allocated, rows_bytes)  -- the SETRANGEs queued behind 'open' hold the rows until EXEC ends
end
-- every check passed: account for the write, then move (or allocate) the keys
if schema ~= '' then
  tds_set_schema(meta, schema, ARGV[8])
end
tds_remember(request, 'W' .. string.format('%.0f', rw_want))
if ARGV[9] ~= '' then
  redis.call('PUBLISH', ARGV[9], 'w')  -- delivered with the EXEC: a reader it wakes finds the rows in
end
local at = next(fresh) ~= nil and tds_deadline_of(meta) or -1
local inv = next(fresh) ~= nil and tds_inventory(meta) or nil
for i = 4, last, 2 do
  if fresh[i] then
    redis.call('DEL', KEYS[i + 1])
    redis.call('SETRANGE', KEYS[i + 1], fresh[i] - 1, '\0')
    tds_record(meta, inv, KEYS[i])
    if at > 0 then
      redis.call('PEXPIREAT', KEYS[i + 1], at)  -- RENAME keeps it
    end
  else
    redis.call('RENAME', KEYS[i], KEYS[i + 1])
  end
end
if inv ~= nil and at > 0 then
  redis.call('PEXPIREAT', inv, at)
end
-- the cursor past the rows (from the count as the ring sees it: a store filled by index starts at
-- its count, as in write.lua), and the mark under which alone 'close' moves the keys back
redis.call('HSET', meta, 'rw', string.format('%.0f', rw + n), 'dw', ARGV[2])
if last < #KEYS then
  tds_stat_keys(last + 1, 0)
  tds_stat_written(rw, n, count)
end
if schema ~= '' then
  version = redis.call('HGET', meta, 'version')
end
return {'GO', version, string.format('%.0f', rw_want)}
