--[[
  read.lua: read byte ranges and whole heterogeneous elements of several leaves,
  atomically, after checking the caller's schema version.

  One call serves element reads, slices, step slices, index lists, masks and full
  reads: the client plans which bytes it needs from its cached header, and this
  script only checks that the header is still current, so a stale cache can never
  return the wrong bytes. Ranges travel packed (int64 pairs in one argument) rather
  than as thousands of ARGV entries, and many small pieces can come back joined, so a
  random batch of 256 elements costs one argument and one reply string per leaf.

  KEYS[1]     store header hash (P:{I}:m)
  KEYS[2..]   data / offset / shape keys of the leaves read, referenced by index

  ARGV[1]     '<epoch>:K<key-set version>' when the leaves were chosen by prefix,
              '<epoch>:*' otherwise (see tds_check in _lib.lua)
  ARGV[2]     'number:version' of every leaf read
  ARGV[3]     number of ops, then each op:
    'R', k, n, ranges, join
          n byte ranges of KEYS[k] (a homogeneous leaf); 'ranges' packs n pairs
          (start, length) as little-endian int64; join = '1' returns them as one
          string, '0' as n strings
    'E', kd, ko, ks, rec, n, runs
          n runs of whole elements of a heterogeneous leaf with data KEYS[kd],
          offset table KEYS[ko] and shape table KEYS[ks] (rec bytes per shape
          record); 'runs' packs n pairs (lo, hi), 0-based inclusive, as int64

  Reply       {'OK', version, pieces...}: for an 'R' op one piece (join) or n pieces;
              for an 'E' op three pieces per run: the raw int64 offsets lo..hi+1, the
              raw shape records lo..hi, and the data bytes of the run.
              {'STALE', header field, value, ...} when a checked version moved.
              {'GONE'} when the store does not exist.
  Errors      'TDSTORE bad argument' for a malformed op (nothing is read).
]]
local meta = KEYS[1]
local bad = tds_check(meta, ARGV[1], ARGV[2])
if bad then
  return bad
end
local out = {'OK', redis.call('HGET', meta, 'version')}
local nops = tds_num(ARGV[3], 'op count')
local a = 4
for _ = 1, nops do
  local kind = ARGV[a]
  if kind == 'R' then
    local key = KEYS[tds_num(ARGV[a + 1], 'key index')]
    local n = tds_num(ARGV[a + 2], 'range count')
    local ranges = ARGV[a + 3]
    local join = ARGV[a + 4] == '1'
    a = a + 5
    if #ranges ~= 16 * n then
      error('TDSTORE bad argument: range table size')
    end
    local pieces = join and {} or out
    local m = #pieces
    for j = 0, n - 1 do
      local start = tds_u64(ranges, 16 * j + 1)
      local len = tds_u64(ranges, 16 * j + 9)
      m = m + 1
      if len > 0 then
        pieces[m] = redis.call('GETRANGE', key, start, start + len - 1)
      else
        pieces[m] = ''
      end
    end
    if join then
      out[#out + 1] = table.concat(pieces)
    end
  elseif kind == 'E' then
    local dkey = KEYS[tds_num(ARGV[a + 1], 'data key index')]
    local okey = KEYS[tds_num(ARGV[a + 2], 'offset key index')]
    local skey = KEYS[tds_num(ARGV[a + 3], 'shape key index')]
    local rec = tds_num(ARGV[a + 4], 'record size')
    local n = tds_num(ARGV[a + 5], 'run count')
    local runs = ARGV[a + 6]
    a = a + 7
    if #runs ~= 16 * n then
      error('TDSTORE bad argument: run table size')
    end
    for j = 0, n - 1 do
      local lo = tds_u64(runs, 16 * j + 1)
      local hi = tds_u64(runs, 16 * j + 9)
      local offs = redis.call('GETRANGE', okey, 8 * lo, 8 * (hi + 2) - 1)
      out[#out + 1] = offs
      if rec > 0 then
        out[#out + 1] = redis.call('GETRANGE', skey, lo * rec, (hi + 1) * rec - 1)
      else
        out[#out + 1] = ''
      end
      local first = tds_u64(offs, 1)
      local last = tds_u64(offs, 8 * (hi - lo + 1) + 1)
      if last > first then
        out[#out + 1] = redis.call('GETRANGE', dkey, first, last - 1)
      else
        out[#out + 1] = ''
      end
    end
  else
    error('TDSTORE bad argument: unknown read op ' .. tostring(kind))
  end
end
return out
