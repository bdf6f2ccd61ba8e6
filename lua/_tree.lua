--[[
  _tree.lua: the priority tree of a ring with server-side priorities (see sampling.lua),
  prepended by tdstore/_engine/scripts.py to the scripts that sample or set priorities, after
  _lib.lua. Not a script on its own.

  The tree lives in one string key (named by the client, tdstore/_format/keys.py): a sum tree of
  fan-out TDS_FAN over the ring's slots. Leaf s holds the weight of slot s (its priority ^
  alpha; 0 for a slot never written or retired) as a little-endian float64; every node above
  holds two float64, the sum of the weights below it and the smallest positive one (0 when
  none: the smallest sampling probability, which importance weights are normalised by).
  Bytes the server zero-filled read as 0, so a new tree costs one SETRANGE at its last byte
  (then tree_build.lua writes the weights of the slots written so far, in bounded steps).

  Layout for capacity C: level 1 is the C leaves (8 bytes each); level k + 1 has
  ceil(n_k / TDS_FAN) nodes (16 bytes each), up to a level of one node, the root (for C = 1,
  the leaf itself). Levels follow each other in the key; tdstore/_format/sampling_policy.py computes the same
  size. A node's children are consecutive, so one GETRANGE reads them all.

  A draw reads one block of children per level, O(TDS_FAN log C), and keeps the blocks it
  parsed for the rest of the call (a batch shares the top of the tree); an update of n
  leaves recomputes each distinct ancestor once, from its children, so sums never drift.
  Values are packed with the struct library where the server has it (Redis, Valkey, KeyDB,
  Dragonfly) and by plain Lua arithmetic where it does not (fakeredis): the bytes are the same.
  Nothing read is trusted: every block a call parses must hold finite weights >= 0 (mins within
  their sums), the root's min is positive exactly when its sum is, and a draw checks each node on
  its path against its children; a weight above TDS_WSUM / count is refused, so no sum overflows.
  A tree edited by hand raises 'TDSTORE damaged' before anything is written.
]]
local TDS_FAN = 16
local tds_struct = nil
do
  local found, lib = pcall(function() return struct end)  -- reading a missing global raises on Redis
  if found and type(lib) == 'table' and lib.unpack ~= nil then
    tds_struct = lib
  end
end

-- The float64 at 1-based position p of s (little-endian), in plain Lua.
local function tds_f64_plain(s, p)
  local b1, b2, b3, b4, b5, b6, b7, b8 = string.byte(s, p, p + 7)
  local sign = b8 >= 128 and -1 or 1
  local e = (b8 % 128) * 16 + math.floor(b7 / 16)
  local m = (((((((b7 % 16) * 256 + b6) * 256 + b5) * 256 + b4) * 256 + b3) * 256 + b2) * 256) + b1
  if e == 0 then
    return sign * m * 2 ^ -1074
  elseif e == 2047 then
    return m == 0 and sign * math.huge or 0 / 0
  end
  return sign * (1 + m / 2 ^ 52) * 2 ^ (e - 1023)
end

-- A finite weight >= 0 as 8 little-endian bytes (IEEE 754), in plain Lua.
local function tds_f64_pack_plain(v)
  if v ~= v or v >= math.huge then
    error('TDSTORE bad argument: a weight that is not finite')
  end
  if v <= 0 then
    return '\0\0\0\0\0\0\0\0'
  end
  local e = math.floor(math.log(v) / math.log(2))
  while e > -1075 and 2 ^ e > v do
    e = e - 1
  end
  while 2 ^ (e + 1) <= v do
    e = e + 1
  end
  local biased, m
  if e < -1022 then
    biased, m = 0, v / 2 ^ -1074  -- subnormal: an exact integer
  else
    biased, m = e + 1023, (v / 2 ^ e - 1) * 2 ^ 52
  end
  local b = {}
  for k = 1, 6 do
    local r = m % 256
    b[k] = r
    m = (m - r) / 256
  end
  b[7] = m + (biased % 16) * 16
  b[8] = math.floor(biased / 16)
  return string.char(b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8])
end

local function tds_f64_pack(v)
  if tds_struct ~= nil then
    return tds_struct.pack('<d', v)
  end
  return tds_f64_pack_plain(v)
end

-- struct formats by node count: every float64 of n leaves, the sums of n nodes, both of n nodes
local tds_formats = {leaves = {}, sums = {}, both = {}}
local function tds_format(kind, n)
  local f = tds_formats[kind][n]
  if f == nil then
    local one = ({leaves = 'd', sums = 'dxxxxxxxx', both = 'dd'})[kind]
    f = '<' .. string.rep(one, n)
    tds_formats[kind][n] = f
  end
  return f
end

-- The float64 of s, in order: every one ('leaves', 'both') or every other one ('sums'), n
-- entries (2n for 'both'). The table may hold one more entry (struct's next position).
local function tds_f64_read(s, kind, n)
  if tds_struct ~= nil then
    return {tds_struct.unpack(tds_format(kind, n), s)}
  end
  local out = {}
  local step = kind == 'sums' and 16 or 8
  for j = 1, (kind == 'both' and 2 * n or n) do
    out[j] = tds_f64_plain(s, step * (j - 1) + 1)
  end
  return out
end

-- The sum of every weight of a tree stays at most TDS_WSUM (float64 ends at 1.8e308), so no sum
-- overflows: a tree of `count` slots takes weights up to TDS_WSUM / count (tdstore/_ring/policy_calls.py
-- refuses larger priorities first, naming the largest allowed).
local TDS_WSUM = 1e307

-- The largest priority whose weight a tree of `count` slots takes under exponent alpha (> 0).
local function tds_max_priority(alpha, count)
  return (TDS_WSUM / math.max(count, 1)) ^ (1 / alpha)
end

-- The weight of priority p (finite, >= 0) under exponent alpha: p ^ alpha, 0 for p = 0. A weight
-- that overflows, or a positive priority whose weight rounds to 0, is refused (before any write);
-- with `count` (the tree's slots), so is a weight above TDS_WSUM / count.
local function tds_weight(p, alpha, count)
  if p <= 0 then
    return 0
  end
  local w = p ^ alpha
  if w ~= w or w >= math.huge or w <= 0 then
    error('TDSTORE refused: priority ' .. string.format('%.17g', p) .. ' ^ alpha ' .. string.format('%.17g', alpha) .. ' is not a finite positive number')
  end
  if count ~= nil and w > TDS_WSUM / math.max(count, 1) then
    error('TDSTORE refused: priority ' .. string.format('%.17g', p) .. ' is too large: with alpha ' .. string.format('%.17g', alpha) .. ' and ' ..
          string.format('%.0f', count) .. ' slots the sum of weights could overflow; the largest allowed priority is ' ..
          string.format('%.6g', tds_max_priority(alpha, count)))
  end
  return w
end

-- The levels of a tree of `count` leaves ({n, at, w}: node count, byte offset, bytes per
-- node; level 1 is the leaves), and the tree's size in bytes.
local function tds_tree_layout(count)
  local levels = {{n = count, at = 0, w = 8}}
  local off = count * 8
  local n = count
  while n > 1 do
    n = math.ceil(n / TDS_FAN)
    levels[#levels + 1] = {n = n, at = off, w = 16}
    off = off + 16 * n
  end
  return levels, off
end

-- A handle on the tree in `key` of a ring of `count` slots; 'TDSTORE damaged' when the key
-- does not hold a whole tree (lost to eviction or deleted), before anything is written.
local function tds_tree(key, count)
  local levels, size = tds_tree_layout(count)
  local have = redis.call('STRLEN', key)
  if have ~= size then
    tds_damaged('the priority tree ' .. key .. ' holds ' .. have .. ' bytes, not ' .. size .. ' (lost or deleted)')
  end
  return {key = key, levels = levels, count = count, blocks = {}, agreed = {}}
end

-- Nodes j0..j1 (0-based, inclusive) of level k: their sums, and with `with_mins` their mins
-- too (a leaf's min is its weight), parsed once per call.
local function tds_tree_nodes(t, k, j0, j1, with_mins)
  local level = t.levels[k]
  local at = level.at + j0 * level.w
  local n = j1 - j0 + 1
  local cached = t.blocks[at]
  if cached ~= nil and cached.n >= n and (cached.mins ~= nil or not with_mins) then
    return cached.sums, cached.mins
  end
  local s = redis.call('GETRANGE', t.key, at, at + n * level.w - 1)
  local sums, mins
  if level.w == 8 then
    sums = tds_f64_read(s, 'leaves', n)
    mins = sums
  elseif with_mins then
    local vals = tds_f64_read(s, 'both', n)
    sums, mins = {}, {}
    for j = 1, n do
      sums[j], mins[j] = vals[2 * j - 1], vals[2 * j]
    end
  else
    sums = tds_f64_read(s, 'sums', n)
  end
  -- every value a finite weight >= 0 (a NaN fails every comparison), every min within its sum
  local huge, bad = math.huge, nil
  for j = 1, n do
    local v = sums[j]
    if not (v >= 0 and v < huge) then
      bad = bad or j
    end
  end
  if mins ~= nil and mins ~= sums then
    for j = 1, n do
      local m = mins[j]
      if not (m >= 0 and m <= sums[j]) then
        bad = bad or j
      end
    end
  end
  if bad ~= nil then
    tds_damaged('the priority tree ' .. t.key .. ' holds ' .. string.format('%.17g', sums[bad]) .. ' (min ' .. string.format('%.17g', mins and mins[bad] or 0) ..
                ') at byte ' .. string.format('%.0f', at + (bad - 1) * level.w) .. ', not a finite weight >= 0 (written by another client?)')
  end
  t.blocks[at] = {n = n, sums = sums, mins = mins}
  return sums, mins
end

-- Check that `sums` (n children) add up to their parent's sum `parent` within float tolerance
-- (an update recomputes each parent from its children in order, so they agree exactly). A draw
-- checks each node once per call (t.agreed): the draws of a batch share the top of the tree.
local function tds_tree_agrees(t, k, j, sums, n, parent)
  local total = 0
  for i = 1, n do
    total = total + sums[i]
  end
  if not (math.abs(total - parent) <= 1e-9 * math.max(total, parent)) then  -- (a NaN fails it too)
    tds_damaged('the priority tree ' .. t.key .. ': node ' .. j .. ' of level ' .. k .. ' holds the sum ' .. string.format('%.17g', parent) ..
                ', its children add up to ' .. string.format('%.17g', total) .. ' (written by another client?)')
  end
end

-- The root's sum and min: the total weight and the smallest positive weight.
local function tds_tree_root(t)
  local sums, mins = tds_tree_nodes(t, #t.levels, 0, 0, true)
  if (sums[1] > 0) ~= (mins[1] > 0) then
    tds_damaged('the priority tree ' .. t.key .. ' holds the total weight ' .. string.format('%.17g', sums[1]) .. ' with the smallest weight ' ..
                string.format('%.17g', mins[1]) .. ' (written by another client?)')
  end
  return sums[1], mins[1]
end

-- The weight of leaf s (from its block of TDS_FAN leaves, which a draw has read already).
local function tds_tree_leaf(t, s)
  local lo = s - s % TDS_FAN
  local sums = tds_tree_nodes(t, 1, lo, math.min(lo + TDS_FAN, t.count) - 1)
  return sums[s - lo + 1]
end

-- The children of node j of level k (k >= 2): their level's range.
local function tds_tree_children(t, k, j)
  local lo = j * TDS_FAN
  return lo, math.min(lo + TDS_FAN, t.levels[k - 1].n) - 1
end

-- The leaf that `mass` (0 <= mass < total) falls in: walking down, the child whose running
-- sum first exceeds the mass; rounding past the last child with weight takes that child,
-- so a leaf of weight 0 is never drawn. nil when the tree holds no weight. `total`: the root's sum,
-- when the caller has it (tds_tree_root). Each node on the path is checked against its children
-- (tds_tree_agrees), once per call.
local function tds_tree_draw(t, mass, total)
  local j = 0
  local parent = total or tds_tree_root(t)
  local agreed = t.agreed
  for k = #t.levels, 2, -1 do
    local lo, hi = tds_tree_children(t, k, j)
    local sums = tds_tree_nodes(t, k - 1, lo, hi)
    local node = t.levels[k].at + 16 * j
    if not agreed[node] then
      agreed[node] = true
      tds_tree_agrees(t, k, j, sums, hi - lo + 1, parent)
    end
    local pick, last = nil, nil
    for i = 1, hi - lo + 1 do
      local v = sums[i]
      if v > 0 then
        last = i
        if mass < v then
          pick = i
          break
        end
        mass = mass - v
      end
    end
    pick = pick or last
    if pick == nil then
      return nil
    end
    j = lo + pick - 1
    parent = sums[pick]
  end
  if #t.levels == 1 and tds_tree_leaf(t, 0) <= 0 then
    return nil
  end
  return j
end

-- Sum and smallest positive min of nodes lo..hi of level k, adding in order.
local function tds_tree_fold(sums, mins, n)
  local total, low = 0, 0
  for i = 1, n do
    total = total + sums[i]
    local m = mins[i]
    if m > 0 and (low == 0 or m < low) then
      low = m
    end
  end
  return total, low
end

-- The block of TDS_FAN nodes of level k holding node j, parsed (sums and mins) and cached.
local function tds_tree_block(t, k, j)
  local lo = j - j % TDS_FAN
  local sums, mins = tds_tree_nodes(t, k, lo, math.min(lo + TDS_FAN, t.levels[k].n) - 1, true)
  return sums, mins, j - lo + 1
end

-- Give leaves new weights (`upd`: slot -> weight) and recompute every ancestor of them, in the
-- call's parsed blocks only: later draws of the same call see the new weights, and nothing
-- reaches the server before tds_tree_flush (a script writes only once it has read everything).
local function tds_tree_set(t, upd)
  t.dirty = t.dirty or {}
  local dirty = {}
  for s, w in pairs(upd) do
    local sums, _, i = tds_tree_block(t, 1, s)
    sums[i] = w  -- a leaf's sums and mins are one table
    t.dirty[t.levels[1].at + 8 * s] = {1, s}
    dirty[math.floor(s / TDS_FAN)] = true
  end
  for k = 2, #t.levels do
    local next_dirty = {}
    for j in pairs(dirty) do
      local lo, hi = tds_tree_children(t, k, j)
      local sums, mins = tds_tree_nodes(t, k - 1, lo, hi, true)
      local total, low = tds_tree_fold(sums, mins, hi - lo + 1)
      local psums, pmins, i = tds_tree_block(t, k, j)
      psums[i], pmins[i] = total, low
      t.dirty[t.levels[k].at + 16 * j] = {k, j}
      next_dirty[math.floor(j / TDS_FAN)] = true
    end
    dirty = next_dirty
  end
end

-- Write every node tds_tree_set changed to the server (one SETRANGE each).
local function tds_tree_flush(t)
  for at, node in pairs(t.dirty or {}) do
    local sums, mins, i = tds_tree_block(t, node[1], node[2])
    if node[1] == 1 then
      redis.call('SETRANGE', t.key, at, tds_f64_pack(sums[i]))
    else
      redis.call('SETRANGE', t.key, at, tds_f64_pack(sums[i]) .. tds_f64_pack(mins[i]))
    end
  end
  t.dirty = {}
end

-- Times slot s was drawn since it was written: 4 little-endian bytes at 4s of `key` (max_times_sampled).
local function tds_times(key, s)
  local b1, b2, b3, b4 = string.byte(redis.call('GETRANGE', key, 4 * s, 4 * s + 3), 1, 4)
  return ((b4 * 256 + b3) * 256 + b2) * 256 + b1
end

-- The 4 bytes of a sample count.
local function tds_times_bytes(c)
  return string.char(c % 256, math.floor(c / 256) % 256, math.floor(c / 65536) % 256, math.floor(c / 16777216) % 256)
end

-- Check that the sample counts of a ring of `count` slots are whole (before anything is written).
local function tds_times_check(key, count)
  if redis.call('STRLEN', key) ~= 4 * count then
    tds_damaged('the sample counts ' .. key .. ' are lost or short')
  end
end
