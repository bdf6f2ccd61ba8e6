-- Distinct rows sampled (lua/README.md "Stats"), on top of _lib.lua's tds_stat: the store's bitmap
-- StoreKeys.sampled_rows (KEYS after the stats hash in an 'A' op), one bit per slot, set when the row in
-- the slot is sampled and cleared when a ring write overwrites the slot. The ring write counts the rows it
-- overwrites as sampled ('ovs') or never sampled ('ovu'), so rows ever sampled = 'ovs' + BITCOUNT of the
-- bitmap. Opt-in: only while the header's 'sd' is '1' (distinct.lua), read here on the server (one HGET,
-- only by a call that samples or overwrites rows), so no stale client can skip or force it. Off, none of
-- this runs: no bitmap, no 'ovs'/'ovu'. Cost when on: one BITFIELD per 1000 rows sampled; O(rows
-- written / 8) bytes per ring write. A bitmap this call creates gets the store's deadline, as tds_stat
-- gives the hash.

local TDS_SEEN_CHUNK = 1000  -- BITFIELD subcommands per call: 4 values each (unpack takes ~8000)

-- The stats keys of an 'A' op: the hash KEYS[k], the bitmap KEYS[k + 1]; 'held' ms the call was held.
-- The bitmap is looked up (tds_seen_key) only when a call needs it.
local function tds_stat_keys(k, held)
  tds_stats.key, tds_stats.seen, tds_stats.held = KEYS[k], false, held
  tds_stats.seen_at = k + 1
end

-- The bitmap's name when the store tracks distinct rows (header 'sd', KEYS[1]), else nil; asked once a call.
local function tds_seen_key()
  if tds_stats.seen == false then
    tds_stats.seen = redis.call('HGET', KEYS[1], 'sd') == '1' and KEYS[tds_stats.seen_at] or nil
  end
  return tds_stats.seen
end

-- The bitmap 'key' was just created by this call: the store's deadline (the header's, KEYS[1]), if any.
local function tds_seen_deadline(key)
  local at = tds_deadline_of(KEYS[1])
  if at > 0 then
    redis.pcall('PEXPIREAT', key, at)
  end
end

-- A counted sample of the slots 'rows' at ring write count 'rw' of a 'count'-slot ring: tds_stat_rows
-- (how many, their ages), the ms it was held, and each row's bit set (never failing the call).
local function tds_stat_sample(rows, rw, count)
  tds_stat_rows(rows, rw, count)
  tds_stat('hr_ms', tds_stats.held)
  if #rows == 0 then
    return
  end
  local key = tds_seen_key()
  if key == nil then
    return
  end
  local fresh = redis.pcall('EXISTS', key) == 0
  local args, k = {}, 0
  for j = 1, #rows do
    args[k + 1], args[k + 2], args[k + 3], args[k + 4] = 'SET', 'u1', string.format('%.0f', rows[j]), '1'
    k = k + 4
    if k >= 4 * TDS_SEEN_CHUNK or j == #rows then
      redis.pcall('BITFIELD', key, unpack(args, 1, k))
      k = 0
    end
  end
  if fresh then
    tds_seen_deadline(key)
  end
end

-- Bits [lo, hi) of 'key' that are set, cleared: how many. The bits in partial bytes go through
-- BITFIELD (at most 7 each end), whole bytes through BITCOUNT and one SETRANGE of zeros: O(n / 8)
-- bytes. Nothing past the string's end is written (those bits are 0).
local function tds_seen_take(key, lo, hi)
  local set = 0
  local function part(from, to)  -- within one byte
    if to > from then
      local w = 'u' .. string.format('%.0f', to - from)
      local v = redis.call('BITFIELD', key, 'GET', w, string.format('%.0f', from))[1]
      if v ~= 0 then
        redis.call('BITFIELD', key, 'SET', w, string.format('%.0f', from), '0')
        while v > 0 do
          set = set + v % 2
          v = math.floor(v / 2)
        end
      end
    end
  end
  local up = math.ceil(lo / 8) * 8  -- the first byte boundary at or after lo
  if hi <= up then
    part(lo, hi)
    return set
  end
  local down = math.floor(hi / 8) * 8
  part(lo, up)
  local len = redis.call('STRLEN', key)
  local b0, b1 = up / 8, math.min(down / 8, len) - 1  -- whole bytes b0..b1
  if b1 >= b0 then
    local c = redis.call('BITCOUNT', key, string.format('%.0f', b0), string.format('%.0f', b1))
    if c > 0 then
      set = set + c
      redis.call('SETRANGE', key, string.format('%.0f', b0), string.rep('\0', b1 - b0 + 1))
    end
  end
  part(down, hi)
  return set
end

-- A counted ring write of 'n' rows from ring write count 'rw' (as the ring counts it: tds_ring_rw) into
-- 'count' slots: the rows counted as inserted ('ins'), and the rows it overwrites (those of ring writes
-- rw - count .. rw + n - 1 - count that exist) as sampled ('ovs') or never sampled ('ovu'), their bits cleared
-- (those two only while the store tracks distinct rows).
local function tds_stat_written(rw, n, count)
  tds_stat('ins', n)
  local first = math.max(rw, count)  -- the first of these writes that overwrites a row
  local over = rw + n - first
  if tds_stats.key == nil or over <= 0 then
    return
  end
  local key = tds_seen_key()
  if key == nil then
    return
  end
  local s = first % count
  local ok, sampled = pcall(tds_seen_take, key, s, math.min(s + over, count))
  if ok and s + over > count then
    local more
    ok, more = pcall(tds_seen_take, key, 0, s + over - count)
    sampled = ok and sampled + more or sampled
  end
  if not ok then
    return  -- another client's value under the key: counting never fails a call
  end
  tds_stat('ovs', sampled)
  tds_stat('ovu', over - sampled)
end
