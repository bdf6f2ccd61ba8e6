--[[
  _lease.lua: helpers prepended (after _lib.lua and _tree.lua) to read.lua (its 'L' op,
  a leased pop) and ack.lua: the lease table of a ring's queue.

  Not a script on its own. Everything hangs off one local table, tds_lease, so the scripts
  it is prepended to keep their count of locals. A leased pop hands items out under a lease
  of a few seconds; an item not acknowledged (ack.lua) by then goes to the next pop again,
  before newer items, in write order, with its delivery count. Items are named by their
  ring write number w (slot w % count), which never repeats.

  The keys (tdstore/_format/keys.py names them; all under the store's hash tag), as the table K:
    K.l   hash   'i<w>' -> '<deliveries> <receipt>' for every outstanding item (receipt ''
                 while it waits for redelivery); 'r<receipt>' -> '<state> <numbers...>':
                 'L w...' a live lease, 'X w...' a lease that expired and was reclaimed,
                 'S w...' a plain pop's items (settled at once; kept so a resend gets them
                 again), 'A k w...' an acknowledged lease: k items settled, then the write
                 numbers that were no longer held
    K.d   zset   live leases: receipt -> deadline (server ms)
    K.q   zset   items waiting for redelivery: w -> w
    K.o   zset   outstanding items (leased or waiting): w -> w; its lowest is the header's
                 'lo', which a writer in queue mode treats as unread
    K.k   zset   settled and expired receipts (L, X, S, A records that are not live): receipt
                 -> server ms; the oldest beyond KEEP lose their record
  Header fields: 'ls' ('1' once a leased pop ran: plain pops then take the 'L' op too),
  'lo' (see K.o; absent when nothing is outstanding).
]]
local tds_lease = {
  KEEP = 4096,  -- settled or expired receipts remembered (an ack or a resend after that: unknown)
  RECLAIM_LEASES = 64,  -- expired leases one pop reclaims at most...
  RECLAIM_ITEMS = 1024,  -- ... stopping once it has reclaimed this many items (whole leases)
}

-- The server's clock in milliseconds (TIME: replicated as its effects on Redis 5+ and 7).
function tds_lease.now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

function tds_lease.fmt(n)
  return string.format('%.0f', n)
end

-- The lease keys of a call: KEYS indices in argument order (l, d, q, o, k).
function tds_lease.keys(args, a)
  local K = {}
  local names = {'l', 'd', 'q', 'o', 'k'}
  for j = 1, 5 do
    local ki = tonumber(args[a + j - 1])
    if ki == nil or KEYS[ki] == nil then
      error('TDSTORE bad argument: lease key index')
    end
    K[names[j]] = KEYS[ki]
  end
  return K
end

-- A receipt as the client made it: letters, digits, '-' and '_', at most 64 characters.
function tds_lease.check_receipt(id)
  if type(id) ~= 'string' or #id < 1 or #id > 64 or string.find(id, '[^%w%-_]') then
    error('TDSTORE bad argument: receipt ' .. tostring(id))
  end
end

-- The record of receipt 'id': its state letter and its numbers, or nil when unknown.
function tds_lease.record(K, id)
  local v = redis.call('HGET', K.l, 'r' .. id)
  if not v then
    return nil, nil
  end
  local nums, state = {}, nil
  for word in string.gmatch(v, '%S+') do
    if state == nil then
      state = word
    else
      local n = tonumber(word)
      if n == nil then
        tds_damaged(K.l .. ' holds a lease record that is not a list of numbers')
      end
      nums[#nums + 1] = n
    end
  end
  return state, nums
end

function tds_lease.set_record(K, id, state, nums)
  local words = {state}
  for j = 1, #nums do
    words[j + 1] = tds_lease.fmt(nums[j])
  end
  redis.call('HSET', K.l, 'r' .. id, table.concat(words, ' '))
end

-- redis.call(cmd, key, ...) over the words of 'args', 1000 at a time (unpack has a limit; pairs
-- stay whole): one command per thousand items instead of one per item.
function tds_lease.batch(cmd, key, args)
  local out = {}
  for i = 1, #args, 1000 do
    local r = redis.call(cmd, key, unpack(args, i, math.min(i + 999, #args)))
    if type(r) == 'table' then
      for j = 1, #r do
        out[#out + 1] = r[j]
      end
    end
  end
  return out
end

-- Items ws: the delivery count and the holder ('' while waiting for redelivery) of each, nil
-- for an item the table no longer holds.
function tds_lease.items(K, ws)
  local fields = {}
  for j = 1, #ws do
    fields[j] = 'i' .. tds_lease.fmt(ws[j])
  end
  local got = tds_lease.batch('HMGET', K.l, fields)
  local ds, owners = {}, {}
  for j = 1, #ws do
    local v = got[j]
    if v then
      local d, owner = string.match(v, '^(%d+) ?(.*)$')
      if d == nil then
        tds_damaged(K.l .. ' holds a lease entry it cannot read')
      end
      ds[j], owners[j] = tonumber(d), owner
    end
  end
  return ds, owners
end

-- Items ws held by 'owner' ('' waiting), with delivery counts ds.
function tds_lease.set_items(K, ws, ds, owner)
  local args = {}
  for j = 1, #ws do
    args[2 * j - 1] = 'i' .. tds_lease.fmt(ws[j])
    args[2 * j] = tds_lease.fmt(ds[j]) .. ' ' .. owner
  end
  tds_lease.batch('HSET', K.l, args)
end

-- Add items ws to the zset 'key', scored by their write number.
function tds_lease.zadd(key, ws)
  local args = {}
  for j = 1, #ws do
    args[2 * j - 1] = ws[j]
    args[2 * j] = tds_lease.fmt(ws[j])
  end
  tds_lease.batch('ZADD', key, args)
end

-- Forget items ws (acknowledged, settled by a plain pop, or overwritten).
function tds_lease.drop(K, ws)
  local fields, members = {}, {}
  for j = 1, #ws do
    members[j] = tds_lease.fmt(ws[j])
    fields[j] = 'i' .. members[j]
  end
  tds_lease.batch('HDEL', K.l, fields)
  tds_lease.batch('ZREM', K.q, members)
  tds_lease.batch('ZREM', K.o, members)
end

-- Remember a receipt that is no longer live (trimming the oldest beyond KEEP: one per call).
function tds_lease.tombstone(K, id, now)
  redis.call('ZADD', K.k, now, id)
  local extra = redis.call('ZCARD', K.k) - tds_lease.KEEP
  if extra > 0 then
    local old = redis.call('ZRANGE', K.k, 0, extra - 1)
    for j = 1, #old do
      redis.call('HDEL', K.l, 'r' .. old[j])
    end
    redis.call('ZREMRANGEBYRANK', K.k, 0, extra - 1)
  end
end

-- Expired leases, earliest deadline first, back to the redelivery queue: at most RECLAIM_LEASES
-- leases, stopping once RECLAIM_ITEMS items are reclaimed (a lease is reclaimed whole, so the
-- last one may pass the budget by its own size, which its own pop handled). Returns the count.
function tds_lease.reclaim(K, now)
  local ids = redis.call('ZRANGEBYSCORE', K.d, '-inf', now, 'LIMIT', 0, tds_lease.RECLAIM_LEASES)
  local items = 0
  for j = 1, #ids do
    if items >= tds_lease.RECLAIM_ITEMS then
      break
    end
    local id = ids[j]
    local state, ws = tds_lease.record(K, id)
    redis.call('ZREM', K.d, id)
    if state == 'L' then
      local ds, owners = tds_lease.items(K, ws)
      local mine, counts = {}, {}
      for j = 1, #ws do
        if ds[j] ~= nil and owners[j] == id then
          mine[#mine + 1] = ws[j]
          counts[#counts + 1] = ds[j]
        end
      end
      tds_lease.set_items(K, mine, counts, '')
      tds_lease.zadd(K.q, mine)
      items = items + #ws
      tds_lease.set_record(K, id, 'X', ws)
      tds_lease.tombstone(K, id, now)
    end
  end
  return items
end

-- Items waiting for redelivery that writers overwrote (w < rw - count): forgotten, at most
-- RECLAIM_ITEMS per call. Returns how many.
function tds_lease.drop_lost(K, rw, count)
  local lost = redis.call('ZRANGEBYSCORE', K.q, '-inf', '(' .. tds_lease.fmt(rw - count), 'LIMIT', 0, tds_lease.RECLAIM_ITEMS)
  local ws = {}
  for j = 1, #lost do
    ws[j] = tonumber(lost[j])
  end
  tds_lease.drop(K, ws)
  return #lost
end

-- After a call changed the lease table: the header's 'lo', the store's time to live on the
-- lease keys, and a message for writers of a full queue.
function tds_lease.settle(meta, K, channel)
  local first = redis.call('ZRANGE', K.o, 0, 0)
  if first[1] then
    redis.call('HSET', meta, 'lo', first[1])
  else
    redis.call('HDEL', meta, 'lo')
  end
  local ttl = redis.call('PTTL', meta)
  if ttl > 0 then
    local at = tds_lease.now_ms() + ttl
    for _, key in pairs(K) do
      redis.call('PEXPIREAT', key, at)
    end
  end
  if channel ~= nil and channel ~= '' then
    redis.call('PUBLISH', channel, 'p')
  end
end
