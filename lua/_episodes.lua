--[[
  _episodes.lua: the episode index of a ring with trajectories (header field 'tj', set by
  trajectories.lua; tdstore/_format/trajectories.py), prepended by tdstore/_engine/scripts.py to
  write.lua (every ring write keeps the index), read.lua (slice samples) and trajectories.lua,
  after _lib.lua. Not a script on its own.

  A trajectory is a run of consecutive ring writes: rows of the same id one after the other
  (by 'id', torchrl's traj_key), or rows up to one whose end flag is set (by 'end', torchrl's
  end_key); the newest run is open (the next write may continue it). The ring holds the write
  numbers max(0, rw - count) .. rw - 1, and the runs cut that range into pieces, oldest first:

    KEYS zset (P:{I}:j)  member: a run's first write number (decimal), score: its length in rows
    header 'jf'          the oldest run's first write number (the next one starts at jf + length)
    header 'jl'          the newest run's first write number
    header 'jv'          by 'id': the newest row's id (16 hex digits); by 'end': '1' when the
                         newest row ended its run (the next row starts another), else '0'
    header 'jx'          present when the index was found inconsistent (a key edited or lost):
                         samples refuse until trajectories.lua builds it again

  A ring write of n rows at write numbers rw .. rw + n - 1 first drops the runs its rows overwrite
  (rows below rw + n - count: the oldest run loses its head, or goes), then appends its rows,
  continuing the newest run or starting new ones: O(runs touched) ZSCORE/ZADD/ZREM, at most
  n + 1 of each, whatever the ring's size. A slice sample draws a trajectory uniformly among those
  long enough (ZCOUNT, then ZREVRANGE by rank over the runs by length: O(log runs) each), as
  torchrl's SliceSampler does, then its start.
]]

local TDS_TWO53 = 9007199254740992

-- The decimal member of write number w.
local function tds_ep_fmt(w)
  return string.format('%.0f', w)
end

-- The 8 bytes of an id as 16 hex digits (what 'jv' holds).
local function tds_ep_hex(id)
  local b1, b2, b3, b4, b5, b6, b7, b8 = string.byte(id, 1, 8)
  return string.format('%02x%02x%02x%02x%02x%02x%02x%02x', b1, b2, b3, b4, b5, b6, b7, b8)
end

-- The index found inconsistent: forget it, mark the header (samples refuse until it is built again).
local function tds_ep_broken(meta, zkey)
  redis.call('DEL', zkey)
  redis.call('HDEL', meta, 'jf', 'jl', 'jv')
  redis.call('HSET', meta, 'jx', '1')
end

-- Check a write's per-row ids (by 'id': n little-endian int64, 8 bytes each) or end flags
-- (by 'end': n bytes, '\0' or '\1') before anything is written.
local function tds_ep_check(by, ids, n)
  local want = by == 'id' and 8 * n or n
  if by ~= 'id' and by ~= 'end' then
    error('TDSTORE damaged: header field tj names no way to tell trajectories apart')
  end
  if #ids ~= want then
    error('TDSTORE bad argument: ' .. #ids .. ' bytes of trajectory ids or end flags for ' .. n .. ' rows')
  end
end

-- Keep the index of ring write rw0 .. rw0 + n - 1 (rw0: the ring's write count before it, as the
-- 'W' op saw it; count: the ring's capacity). Called after the rows are written, with tds_ep_check passed.
local function tds_ep_write(meta, zkey, by, rw0, n, count, ids)
  local h = redis.call('HMGET', meta, 'jf', 'jl', 'jv', 'jx')
  if h[4] then
    return  -- a broken index stays broken until rebuilt
  end
  local low = math.max(0, rw0 + n - count)
  local jf, jl, jv = tonumber(h[1]), tonumber(h[2]), h[3]
  if (jf == nil) ~= (jl == nil) or (jf ~= nil and (jf > jl or jl >= rw0 or jf < rw0 - count))
    or (jl ~= nil and redis.call('ZSCORE', zkey, tds_ep_fmt(jl)) == false) then  -- the index lost or edited
    tds_ep_broken(meta, zkey)
    return
  end
  -- the rows this write overwrites: the oldest runs lose them
  while jf ~= nil and jf < low do
    local len = tonumber(redis.call('ZSCORE', zkey, tds_ep_fmt(jf)))
    if len == nil or len < 1 or jf + len > rw0 then
      tds_ep_broken(meta, zkey)
      return
    end
    redis.call('ZREM', zkey, tds_ep_fmt(jf))
    if jf + len > low then  -- its head overwritten, its tail still there
      redis.call('ZADD', zkey, jf + len - low, tds_ep_fmt(low))
      if jl == jf then
        jl = low
      end
      jf = low
    elseif jl == jf then  -- the newest run went too: the index is empty
      jf, jl, jv = nil, nil, nil
    else
      jf = jf + len
    end
  end
  -- the new rows: a run per change of id (or after each end flag), the first maybe continuing the newest run
  local sub, byte = string.sub, string.byte
  local j = 1
  while j <= n do
    local k = j
    local cont
    if by == 'id' then
      local id = sub(ids, 8 * j - 7, 8 * j)
      cont = j == 1 and jl ~= nil and jv == tds_ep_hex(id)
      while k < n and sub(ids, 8 * k + 1, 8 * k + 8) == id do
        k = k + 1
      end
    else
      cont = j == 1 and jl ~= nil and jv == '0'
      while k < n and byte(ids, k) == 0 do
        k = k + 1
      end
      jv = byte(ids, k) == 0 and '0' or '1'
    end
    local len = k - j + 1
    if cont then
      redis.call('ZINCRBY', zkey, len, tds_ep_fmt(jl))
    else
      jl = rw0 + j - 1
      redis.call('ZADD', zkey, len, tds_ep_fmt(jl))
      if jf == nil then
        jf = jl
      end
    end
    j = k + 1
  end
  if by == 'id' then
    jv = tds_ep_hex(sub(ids, 8 * n - 7, 8 * n))  -- the newest row's id
  end
  redis.call('HSET', meta, 'jf', tds_ep_fmt(jf), 'jl', tds_ep_fmt(jl), 'jv', jv)
  if h[1] == nil then  -- the index may be new: it expires with the store
    local at = tds_deadline_of(meta)
    if at > 0 then
      redis.call('PEXPIREAT', zkey, at)
    end
  end
end

-- Draw m slices of up to L rows (torchrl's SliceSampler): draws packs 2 * m int64 in [0, 2^53)
-- (the trajectory's, then the start's, per slice); strict: only trajectories of at least L rows
-- (else a shorter one gives a slice of its length); span0 / span1: torchrl's span on the left and
-- the right (0: none, -1: True, k > 0: up to k rows past the trajectory's edge, cut off).
-- Returns the slots of every row (in order), and per slice its trajectory's first write number, its
-- length, the slice's offset in it and its length (four int64 each, packed).
-- ranked > 0 (a sampler without replacement): each slice's first int64 is the rank of its trajectory among
-- the eligible ones (longest first), which the client drew from a permutation of 'ranked' of them; when the
-- ring holds another number of eligible trajectories, returns nil and that number (nothing drawn).
local function tds_ep_slices(meta, zkey, count, rw, m, L, strict, span0, span1, draws, ranked)
  if redis.call('HEXISTS', meta, 'jx') == 1 then
    error('TDSTORE damaged: the episode index of this ring is inconsistent (a key edited or lost): set_trajectories builds it again')
  end
  local total = redis.call('ZCARD', zkey)
  if total == 0 then
    error('TDSTORE empty: the ring holds no trajectory yet')
  end
  local eligible = total
  if strict then
    eligible = redis.call('ZCOUNT', zkey, L, '+inf')
    if eligible == 0 then
      local top = redis.call('ZREVRANGE', zkey, 0, 0, 'WITHSCORES')
      error('TDSTORE refused: no trajectory of at least ' .. L .. ' rows (the longest has ' .. top[2] .. ')')
    end
  end
  if ranked > 0 and ranked ~= eligible then
    return nil, eligible
  end
  local slots, info = {}, {}
  local low = math.max(0, rw - count)
  for i = 1, m do
    local r
    if ranked > 0 then
      r = tds_u64(draws, 16 * i - 15)
      if r >= eligible then
        error('TDSTORE bad argument: trajectory rank ' .. r .. ' of ' .. eligible)
      end
    else
      r = math.floor(tds_u64(draws, 16 * i - 15) / TDS_TWO53 * eligible)
    end
    local got = redis.call('ZREVRANGE', zkey, r, r, 'WITHSCORES')
    local start, len = tonumber(got[1]), tonumber(got[2])
    if start == nil or len == nil or len < 1 or start < low or start + len > rw then
      error('TDSTORE damaged: the episode index holds a trajectory outside the ring (' .. tostring(got[1]) .. ')')
    end
    local seq = math.min(L, len)
    local hi, lo
    if span1 == 0 then
      hi = len - seq + 1
    elseif span1 < 0 then
      hi = len + 1
    else
      hi = len - span1
    end
    if span0 == 0 then
      lo = 0
    elseif span0 < 0 then
      lo = 1 - seq
    else
      lo = -span0
    end
    local rel = math.floor(tds_u64(draws, 16 * i - 7) / TDS_TWO53 * (hi - lo)) + lo
    if span0 ~= 0 and rel < 0 then
      seq = seq + rel
      rel = 0
    end
    if span1 ~= 0 and rel + seq > len then
      seq = len - rel
    end
    for t = 0, seq - 1 do
      slots[#slots + 1] = tds_p64((start + rel + t) % count)
    end
    info[#info + 1] = tds_p64(start) .. tds_p64(len) .. tds_p64(rel) .. tds_p64(math.max(seq, 0))
  end
  return slots, table.concat(info)
end
