--[[
  direct.lua: the two ends of a ring write whose rows travel as plain SETRANGEs
  (tdstore/_ring/direct_extend.py). A row argument of a script costs the server about 1.2 us per KiB
  to become a Lua string (a 500-row extend of 150 KB: 0.2 ms, against 5 us for SETRANGE),
  so the client sends, in one round trip:

      MULTI
      EVALSHA direct 'open' ...         check, reserve: each data key K moves to K:w (RENAME)
      SETRANGE K:w offset rows ...      the rows, at the slots the client expects
      EVALSHA direct 'close' ...        K:w moves back to K; the ring cursor advances
      EXEC

  Everything runs inside one EXEC: no other client sees a key moved, or a row without its
  cursor. 'open' moves every key or none (its checks all come first); 'close' moves them back only
  when 'open' moved them (K gone, K:w a string). When 'open' refuses (stale schema, another writer moved the cursor, a key lost or
  never allocated, a sampling policy, a resent request), it makes each K:w a hash instead:
  the SETRANGEs fail on it (WRONGTYPE) and write nothing, and 'close' deletes it. The data
  keys are never the SETRANGEs' targets, so a transaction whose scripts the server does not
  know (NOSCRIPT: both ends are this one script) writes only to the K:w names, which nothing
  reads; the client deletes them and sends the write through write.lua.

  KEYS[1]     store header hash
  KEYS[2]     the store's reply cache (see tds_request in _lib.lua)
  KEYS[3..]   pairs: a data key K the rows go to, then K:w

  ARGV[1]     'open' or 'close'
  ARGV[2]     the request id of the write (hex, see tds_request)
  ARGV[3]     the ring write counter 'rw' the client expects (the rows' slots follow from it)
  ARGV[4]     rows
  open only:
  ARGV[5]     '<epoch>:K<key-set version>' (see tds_check)
  ARGV[6]     'number:version' of every leaf written (see tds_check)
  ARGV[7..]   per pair of KEYS, the bytes its data key holds (count * row bytes)
  close only:
  ARGV[5]     the Pub/Sub channel to publish 'w' on ('' for none)

  Reply       open: {'GO'} (the rows go in), {'DONE', version, rw before} for a request
              recorded by an earlier attempt (nothing written), {'MOVED', rw} when the
              cursor is elsewhere, {'SCRIPT'} when write.lua must do it (a sampling policy,
              a store filled by index, a key not allocated or not as long as expected:
              write.lua allocates it or names it lost), {'GONE'} or {'STALE', header...}.
              close: {'OK', version, rw before} when the rows went in, else {'NO'}.
  Errors      'TDSTORE bad argument' for malformed arguments; a header field out of range
              raises as in write.lua.
]]
local meta = KEYS[1]
local mode = ARGV[1]
local rw_want, n = tds_num(ARGV[3], 'ring write counter'), tds_num(ARGV[4], 'row count')
if #KEYS < 4 or #KEYS % 2 ~= 0 then
  error('TDSTORE bad argument: direct.lua takes pairs of keys')
end

if mode == 'close' then
  -- 'open' went through only if it moved every data key aside: each K gone, each K:w a string. Else
  -- (refused: K:w a hash; 'open' raised an error: K:w made by the SETRANGEs, zeros and rows) K:w goes
  if redis.call('EXISTS', KEYS[3]) == 1 or redis.call('TYPE', KEYS[4]).ok ~= 'string' then
    for i = 4, #KEYS, 2 do
      redis.call('DEL', KEYS[i])
    end
    return {'NO'}
  end
  for i = 3, #KEYS, 2 do
    redis.call('RENAME', KEYS[i + 1], KEYS[i])
  end
  local request = tds_request(2, ARGV[2])
  redis.call('HINCRBY', meta, 'rw', string.format('%.0f', n))
  tds_remember(request, 'W' .. string.format('%.0f', rw_want))
  if ARGV[5] ~= '' then
    redis.call('PUBLISH', ARGV[5], 'w')
  end
  return {'OK', redis.call('HGET', meta, 'version'), string.format('%.0f', rw_want)}
elseif mode ~= 'open' then
  error('TDSTORE bad argument: direct.lua mode ' .. tostring(mode))
end

local function refuse(reply)
  for i = 4, #KEYS, 2 do
    redis.call('DEL', KEYS[i])
    redis.call('HSET', KEYS[i], 'refused', '1')  -- the SETRANGEs fail on a hash: nothing written
  end
  return reply
end
local request = tds_request(2, ARGV[2])
if request.seen then
  local version = redis.call('HGET', meta, 'version')
  if not version then
    return refuse({'GONE'})
  end
  return refuse({'DONE', version, string.sub(request.seen, 2)})
end
local bad = tds_check(meta, ARGV[5], ARGV[6])
if bad then
  return refuse(bad)
end
local head = redis.call('HMGET', meta, 'count', 'rw', 'sc')
local count, rw = tds_ring_fields(head[1], head[2])
if head[3] or rw == 0 or n < 1 or n > count then
  return refuse({'SCRIPT'})
end
if rw ~= rw_want then
  return refuse({'MOVED', string.format('%.0f', rw)})
end
for i = 3, #KEYS, 2 do
  if redis.call('STRLEN', KEYS[i]) ~= tds_num(ARGV[7 + (i - 3) / 2], 'key size') then
    return refuse({'SCRIPT'})
  end
end
for i = 3, #KEYS, 2 do
  redis.call('RENAME', KEYS[i], KEYS[i + 1])
end
return {'GO'}
