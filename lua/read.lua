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
  KEYS[2]     the store's inventory hash when the header has the field 'na' (see _lib.lua)
  KEYS[2..]   data / offset / shape keys of the leaves read, and the reply cache of an 'N' op, referenced by index

  ARGV[1]     '<epoch>:K<key-set version>' when the leaves were chosen by prefix,
              '<epoch>:*' otherwise (see tds_check in _lib.lua)
  ARGV[2]     'number:version' of every leaf read
  ARGV[3]     number of ops, then each op. The client declares each kind once, in
              tdstore/_format/op_kinds.py (class Read: its arguments, which are KEYS indices, and
              how many reply pieces it adds); a new kind is an entry there and its parser here:
    'R', k, n, ranges, join
          n byte ranges of KEYS[k] (a homogeneous leaf); 'ranges' packs n pairs
          (start, length) as little-endian int64; join = '1' returns them as one
          string, '0' as n strings
    'E', kd, ko, ks, rec, n, runs
          n runs of whole elements of a heterogeneous leaf with data KEYS[kd],
          offset table KEYS[ko] and shape table KEYS[ks] (rec bytes per shape
          record); 'runs' packs n pairs (lo, hi), 0-based inclusive, as int64

    'U', n, draws
          sample n rows uniformly from the written slots of the ring: 'draws' packs
          n int64 values drawn by the client in [0, 2^53) (so a seeded generator
          gives the same rows), and row j is draw_j % min(rw, count), where rw is
          the header's ring write counter (a store holding data the ring never wrote,
          written by index, is a full ring: rw = count; see tds_ring_rw in _lib.lua).
          A ring restored with rows absent (header field 'ho', see _absent.lua) draws
          among the rows it holds instead: row j is (ho + draw_j % (rw - ho)) % count.
          Must come before its 'X'/'Y' ops.
          A store with a sampling policy answers STALE: its samples take a 'P' op.
    'J', m, L, strict, span0, span1, draws, kj, ranked
          slices of trajectories (a ring with trajectories, see _episodes.lua and its index KEYS[kj]):
          m slices of up to L consecutive rows, each inside one trajectory, drawn as torchrl's
          SliceSampler draws them ('draws' packs 2 * m int64 in [0, 2^53); strict '1': only
          trajectories of at least L rows; span0/span1: 0, -1 for True, or k). ranked > 0: each
          slice's first draw is its trajectory's rank among the 'ranked' eligible ones (a sampler
          without replacement); another count answers {'WAIT', 'moved', count}. Adds three pieces:
          the slots of every row, rw, and per slice four int64 (its trajectory's first write
          number and length, the slice's offset in it and its length). Must come before its
          'X'/'Y' ops. Errors: 'TDSTORE empty' (no trajectory yet), 'TDSTORE refused' (strict and
          no trajectory long enough). A ring without a trajectory setting answers STALE.
    'P', n, draws, kt, kc, channel, min_size, prioritized
          sample n rows under the ring's sampling policy (header field 'sc', see
          sampling.lua): wait (reply WAIT, nothing read) while fewer than min_size (or the
          rate limiter's) slots are written or the limiter holds samples; with
          prioritized = '1', draw each row from the priority tree KEYS[kt] (see _tree.lua):
          mass draw_j / 2^53 * total, one after the other, so a slot that reaches
          max_times_sampled (counts in KEYS[kc]) is retired before the next draw (the batch
          is shorter when every slot is retired); else as 'U'. Counts the rows as samples
          for the limiter and publishes on the Pub/Sub 'channel'. Adds four pieces: the
          slots, rw, each row's sampling probability and the smallest probability of any
          slot followed by the tree's sum (the mass the probabilities divide by: a sharded
          ring's next split), as little-endian float64 ('' and '' for a uniform sample).
    'F', n, channel
          pop: the next min(n, unread) items in write order (the header's read cursor 'rr'
          moves past them, so each goes to one reader); adds two pieces: their slots and
          rw. Reply {'WAIT', 'empty', ...} when nothing is unread, {'LOST', k} when writers
          overwrote k unread items (the cursor then moves to the oldest item left).
    'L', n, channel, ms, receipt, kl, kd, kq, ko, kk
          leased pop (see _lease.lua for the lease keys KEYS[kl..kk]): first the items
          whose lease expired (up to 64 expired leases, stopping past 1024 items, are
          reclaimed per call), lowest write number first, then the next unread items, up
          to n in all, in write order. With ms > 0 they are leased to 'receipt' (made by
          the client) until the server's clock (TIME) passes now + ms; ack.lua settles
          them. With ms = 0 (a plain pop on a store that has leases) they are settled at
          once. A receipt the lease table already holds (a resend after a lost reply)
          gets the same items again and takes nothing. Adds five pieces: slots, rw,
          the items' write numbers and delivery counts (int64 each), and
          '<deadline ms> <kv>' (kv: the key-set version after the call: the first
          leased pop sets the header's 'ls' and bumps 'kv', so plain pops planned before
          it are answered STALE and take this op). Reply {'WAIT', 'empty', ...} when
          nothing is unread or waiting, {'LOST', k} when writers overwrote k unread or
          waiting items (forgotten; the cursor moves to the oldest item left).
    'G', mode, n, groups, staleness, budget, fixed, draws, channel, kz, kr, kg, ks, kq
          a ring with rollouts (see _rollouts.lua, keys KEYS[kz..kq]): mode 's' samples n
          visible rows (groups = '1': n whole groups) uniformly, with 'draws' as 'U', among
          those of version >= cv - staleness ('' : all), by rank in a sorted set (exact,
          O(log slots) a row); mode 'p' pops queue entries in order: n rows (never part of
          a group), n groups, or (budget) entries while their lengths (the 'H' op's leaf,
          or 'fixed' per row) add up to at most 'budget'; entries with a row overwritten
          (lost) or of a version below cv - staleness (stale) are dropped and counted.
          Adds five pieces: slots, rw, each row's version (int64), rows per entry or
          group (int64), and '<stale> <lost>'. Reply WAIT ('empty', 'stale') when nothing
          qualifies; a budget smaller than the next entry, or a group larger than n rows,
          is refused ('TDSTORE refused') before anything changes.
    'H', ko, ks, rec, isz
          before 'G': the leaf whose elements' first dim is a row's length (offset and shape
          key blocks, record size, item size), read by a pop with a token budget
    'N', k, rid
          the call's request id (before a 'P' or 'F' op): KEYS[k] is the store's reply cache
          (see tds_request in _lib.lua). A pop, or a sample that counts (rate limiter,
          max_times_sampled), records what it took under the id; when the id is recorded
          already (a resend), the 'P' or 'F' op takes the recorded rows again (a pop's
          from its recorded range, a sample's from its recorded slots, or from the draws
          over the recorded slot count) and reads them as they are now, with today's rw,
          changing nothing; a resent pop whose items writers overwrote since answers
          {'LOST', k, 'resent'}, never other rows.
    'A', k, ms
          count this call's ring work in the store's stats hash KEYS[k] (see tds_stat in
          _lib.lua; before the 'U', 'P', 'F' or 'L' op): rows sampled ('smp') and their age in
          ring writes ('age_sum', 'age_max': a row written by ring write w, sampled at rw, is
          rw - 1 - w old), items popped ('pop'), redelivered ('rdl'), whose lease lapsed
          ('exp') or that writers overwrote unread ('lost'), WAIT replies of samples ('hr'),
          and the ms the client's call was held back before this try, once it goes through
          (a sample's 'hr_ms', a pop's 'hp_ms'); a sample sets its rows' bits in the
          sampled-rows bitmap KEYS[k + 1] (see _seen.lua)
    'I', n, rows
          the rows of the 'X' ops after it: n element ids packed as int64 (a scattered
          batch read decodes its ids once, instead of one range per row and leaf)
    'X', k, nb
          the nb-byte element of each row (sampled by 'U' or named by 'I') of a
          homogeneous leaf, joined
    'B', k, nb
          the same as 'X', but each segment blob a row falls in is read whole once (GET)
          and the rows are cut from it in Lua: for a small blob and many rows this costs
          far less server time than one GETRANGE per row
    'Y', kd, ko, ks, rec
          each sampled row of a heterogeneous leaf: three pieces, the packed
          (start, end) byte offsets of every row, their shape records, their data
    'V', kd, ko, ks, rec
          the same as 'Y', but each segment's offset and shape tables a row falls in
          are read whole once (GET) and the rows' records cut from them in Lua, as 'B'
          does for a homogeneous leaf: one GETRANGE per row (its data) instead of three
    'T', ko
          the whole offset table KEYS[ko] of one segment of a heterogeneous leaf, as the
          server holds it ('' when absent): one piece. The client keeps it to read the
          leaf's rows later as plain GETRANGEs in a transaction that reads each row's
          offsets back (tdstore/_format/offsets.py); it checks the table's size itself
    'Q', per
          the store is cut into segments of 'per' elements (must come before 'U'/'I'):
          the key indices of the 'X'/'Y' ops after it each name the first of a block
          of consecutive KEYS, one per segment; row r is read from segment
          floor(r / per) at index r % per (the (start, end) offsets of 'Y' are then
          local to the row's segment)

  Reply       {'OK', version, pieces...}; a 'U' op adds two pieces where it stands:
              the sampled slots packed as int64, and rw (as a decimal string).: for an 'R' op one piece (join) or n pieces;
              for an 'E' op three pieces per run: the raw int64 offsets lo..hi+1, the
              raw shape records lo..hi, and the data bytes of the run.
              {'STALE', header field, value, ...} when a checked version moved.
              {'GONE'} when the store does not exist.
              {'WAIT', reason, message} and {'LOST', k}: see the 'P', 'F' and 'L' ops;
              {'LOST', k, 'resent'}: see the 'N' op.
              Every piece is checked: a key shorter than the header implies raises
              'TDSTORE damaged' (a key of the store lost to eviction or deletion), except
              a key the store's inventory (KEYS[2], see _lib.lua) says was never
              allocated, which reads as zeros.
  Errors      'TDSTORE bad argument' for a malformed op (nothing is read);
              'TDSTORE refused' for an 'L' op whose receipt was acknowledged already;
              'TDSTORE empty' when a 'U' op finds no written slot;
              'TDSTORE damaged' when a key the header says holds data is lost or short, a
              header field a ring op reads (count, rw, rr, sn, lb, sc, na, inner) is out of
              range, a priority tree value is not a finite weight >= 0 or disagrees with its
              parent along a draw's path, or an offset table decreases.
]]
local meta = KEYS[1]
local bad = tds_check(meta, ARGV[1], ARGV[2])
if bad then
  return bad
end
local out = {'OK', redis.call('HGET', meta, 'version')}
-- what 'P' and 'F' ops change (sample counts, retirements, the read cursor): done once every op
-- has read its pieces, so a read that fails (a damaged key) changes nothing
local finish = {}
local nops = tds_num(ARGV[3], 'op count')
local a = 4
local rows = nil  -- slots drawn by a 'U' op, read by the 'X'/'Y' ops after it
local request, decision = nil, nil  -- an 'N' op's request id; what a 'P' or 'F' op decided, recorded under it
-- Bytes [start, start + len) of the key of segment seg in the KEYS block starting at ki: by
-- GETRANGE, or, given a cache table ('B' and 'V' ops), cut from the whole value read once per segment.
local function seg_range(cache, ki, seg, start, len, strict, rec)
  local key = tds_segkey(ki, seg)
  if cache == nil then
    return tds_whole(meta, key, redis.call('GETRANGE', key, start, start + len - 1), len, strict, rec)
  end
  local blob = cache[seg]
  if blob == nil then
    blob = redis.call('GET', key) or ''
    cache[seg] = blob
  end
  return tds_whole(meta, key, string.sub(blob, start + 1, start + len), len, strict, rec)
end
local seg_per = nil  -- elements per segment, set by a 'Q' op
local lost_reply = nil  -- an 'F' op's {'LOST', k}: sent instead of the pieces, once every op has read
local ring_count, counted_keys = nil, {}  -- the count a 'U', 'P' or 'F' op's slots are modulo, and the keys checked against it
local length_leaf = nil  -- an 'H' op's leaf, whose lengths a 'G' pop with a token budget adds up
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
        pieces[m] = tds_whole(meta, key, redis.call('GETRANGE', key, start, start + len - 1), len)
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
      local offs = tds_whole(meta, okey, redis.call('GETRANGE', okey, 8 * lo, 8 * (hi + 2) - 1), 8 * (hi - lo + 2))
      out[#out + 1] = offs
      if rec > 0 then
        out[#out + 1] = tds_whole(meta, skey, redis.call('GETRANGE', skey, lo * rec, (hi + 1) * rec - 1), (hi - lo + 1) * rec, false, rec)
      else
        out[#out + 1] = ''
      end
      local first = tds_u64(offs, 1)
      local last = tds_u64(offs, 8 * (hi - lo + 1) + 1)
      -- the run's bounds only: the client checks every element's size against the bytes read
      -- (tdstore/_plan/read_results.py check_elements), so the table is not decoded here entry by entry
      tds_bounds_rise(okey, first, last, lo)
      if last > first then
        out[#out + 1] = tds_whole(meta, dkey, redis.call('GETRANGE', dkey, first, last - 1), last - first, true)
      else
        out[#out + 1] = ''
      end
    end
  elseif kind == 'U' then
    if rows ~= nil then
      error('TDSTORE bad argument: one U, P or F op per call')
    end
    local n = tds_num(ARGV[a + 1], 'row count')
    local draws = ARGV[a + 2]
    a = a + 3
    if #draws ~= 8 * n then
      error('TDSTORE bad argument: draw table size')
    end
    local head = redis.call('HMGET', meta, 'count', 'rw', 'schema', 'sc')
    if head[4] then
      do return tds_stale(meta) end  -- a client that does not know the sampling policy: it must sample under it
    end
    local count, rw = tds_ring_fields(head[1], head[2])
    rw = tds_ring_rw(meta, count, rw)
    ring_count = count
    local from = tds_held_from(meta, rw, count)  -- rows a restore left absent are skipped (_absent.lua)
    local written = from and rw - from or math.min(rw, count)
    if written == 0 then
      error('TDSTORE empty: no slot of the ring has been written yet')
    end
    rows = {}
    local packed = {}
    for j = 1, n do
      rows[j] = tds_held_slot(tds_u64(draws, 8 * j - 7), written, from, count)
      packed[j] = tds_p64(rows[j])
    end
    if tds_stats.key ~= nil then
      finish[#finish + 1] = function() tds_stat_sample(rows, rw, count) end
    end
    out[#out + 1] = table.concat(packed)
    out[#out + 1] = string.format('%.0f', rw)
  elseif kind == 'J' then
    if rows ~= nil then
      error('TDSTORE bad argument: one U, J, P or F op per call')
    end
    local m, L = tds_num(ARGV[a + 1], 'slice count'), tds_num(ARGV[a + 2], 'slice length')
    local strict, span0, span1 = ARGV[a + 3] == '1', tds_num(ARGV[a + 4], 'span'), tds_num(ARGV[a + 5], 'span')
    local draws, zkey, ranked = ARGV[a + 6], KEYS[tds_num(ARGV[a + 7], 'key index')], tds_num(ARGV[a + 8], 'ranked')
    a = a + 9
    if #draws ~= 16 * m or m < 1 or L < 1 then
      error('TDSTORE bad argument: slice draws')
    end
    local head = redis.call('HMGET', meta, 'count', 'rw', 'tj')
    if not head[3] then
      do return tds_stale(meta) end  -- the setting was dropped since the client planned
    end
    local count, rw = tds_ring_fields(head[1], head[2])
    rw = tds_ring_rw(meta, count, rw)
    ring_count = count
    local packed, info = tds_ep_slices(meta, zkey, count, rw, m, L, strict, span0, span1, draws, ranked)
    if packed == nil then
      do return {'WAIT', 'moved', string.format('%.0f', info)} end  -- the client's permutation is of another count
    end
    rows = {}
    for j = 1, #packed do
      rows[j] = tds_u64(packed[j], 1)
    end
    if tds_stats.key ~= nil then
      finish[#finish + 1] = function() tds_stat_sample(rows, rw, count) end
    end
    out[#out + 1] = table.concat(packed)
    out[#out + 1] = string.format('%.0f', rw)
    out[#out + 1] = info
  elseif kind == 'A' then
    tds_stat_keys(tds_num(ARGV[a + 1], 'key index'), tds_num(ARGV[a + 2], 'held ms'))
    a = a + 3
  elseif kind == 'N' then
    request = tds_request(ARGV[a + 1], ARGV[a + 2])
    a = a + 3
  elseif (kind == 'P' or kind == 'F') and request ~= nil and request.seen then
    -- a resent sample or pop (its request id recorded): the rows the first attempt took, read again
    -- as they are now (generations from today's rw), nothing counted or moved again
    if rows ~= nil then
      error('TDSTORE bad argument: one U, P or F op per call')
    end
    local n, seen = tds_num(ARGV[a + 1], 'row count'), request.seen
    local draws = ARGV[a + 2]
    a = a + (kind == 'P' and 8 or 3)
    local head = redis.call('HMGET', meta, 'count', 'rw')
    local count, rw = tds_ring_fields(head[1], head[2])
    rw = tds_ring_rw(meta, count, rw)
    ring_count = count
    local what = string.sub(seen, 1, 1)
    rows = {}
    local packed, probs, low_prob = {}, '', ''
    if what == 'L' then
      do return {'LOST', string.sub(seen, 2)} end
    elseif what == 'F' then
      local rr, k = string.match(seen, '^F(%d+) (%d+)$')
      rr, k = tonumber(rr), tonumber(k)
      if rr < rw - count then  -- writers overwrote what the first attempt popped: lost, never other bytes
        do return {'LOST', string.format('%.0f', k), 'resent'} end
      end
      for j = 1, k do
        rows[j] = (rr + j - 1) % count
        packed[j] = tds_p64(rows[j])
      end
    elseif what == 'P' then  -- by priority: the smallest probability, the tree's sum, the slots drawn, their probabilities
      local head = (#seen - 9) % 16 == 0 and 9 or 17  -- a record without the sum: 9 bytes before the slots
      local m = (#seen - head) / 16
      low_prob, probs = string.sub(seen, 2, head), string.sub(seen, head + 1 + 8 * m)
      packed[1] = string.sub(seen, head + 1, head + 8 * m)
      for j = 1, m do
        rows[j] = tds_u64(packed[1], 8 * j - 7)
      end
    else  -- uniformly: the draws again, over the slots written then
      local written, from = string.match(seen, '^U(%d+)@?(%d*)$')
      written, from = tds_num(written, 'recorded slot count'), tonumber(from)
      for j = 1, n do
        rows[j] = tds_held_slot(tds_u64(draws, 8 * j - 7), written, from, count)
        packed[j] = tds_p64(rows[j])
      end
    end
    out[#out + 1] = table.concat(packed)
    out[#out + 1] = string.format('%.0f', rw)
    if kind == 'P' then
      out[#out + 1] = probs
      out[#out + 1] = low_prob
    end
  elseif kind == 'P' then
    -- a sample under the ring's sampling policy: waits (reply WAIT) for min_size or the rate
    -- limiter, draws by priority or uniformly, counts the samples, retires worn-out slots
    if rows ~= nil then
      error('TDSTORE bad argument: one U, P or F op per call')
    end
    local n = tds_num(ARGV[a + 1], 'row count')
    local draws = ARGV[a + 2]
    local tkey, times_key = KEYS[tds_num(ARGV[a + 3], 'key index')], KEYS[tds_num(ARGV[a + 4], 'key index')]
    local channel, min_size, by_priority = ARGV[a + 5], tds_num(ARGV[a + 6], 'min_size'), ARGV[a + 7] == '1'
    a = a + 8
    if #draws ~= 8 * n then
      error('TDSTORE bad argument: draw table size')
    end
    local head = redis.call('HMGET', meta, 'count', 'rw', 'sc', 'sn', 'lb', 'schema')
    local count, rw = tds_ring_fields(head[1], head[2])
    rw = tds_ring_rw(meta, count, rw)
    ring_count = count
    local policy = tds_policy(head[3]) or {}
    local from = tds_held_from(meta, rw, count)  -- rows a restore left absent are skipped (_absent.lua)
    local written = from and rw - from or math.min(rw, count)
    local lim = policy.limit
    if lim ~= nil then
      min_size = math.max(min_size, lim[2])
    end
    if written < math.max(min_size, 1) then
      tds_stat('hr', 1)
      do return {'WAIT', written == 0 and 'empty' or 'size', 'the ring holds ' .. written .. ' written slots, fewer than the ' .. math.max(min_size, 1) .. ' a sample needs'} end
    end
    if lim ~= nil and (rw - tds_int_field(head[5], 'lb', 0, rw, 0)) * lim[1] - (tds_int_field(head[4], 'sn', 0, TDS_MAXINT, 0) + 1) < lim[3] then  -- its first row (see write.lua)
      tds_stat('hr', 1)
      do return {'WAIT', 'sample', 'the rate limiter holds samples until the writers catch up'} end
    end
    if by_priority and policy.alpha == nil then
      error('TDSTORE refused: the store has no priorities (enable_priorities first)')
    end
    if not by_priority and policy.mt ~= nil then
      error('TDSTORE refused: the store retires slots after max_times_sampled samples, which only a prioritized sample counts')
    end
    rows = {}
    local packed, probs = {}, {}
    local low_prob, mass = '', ''
    local counted = {}  -- slot -> its sample count after this call (written when every op has read)
    if by_priority then
      local t = tds_tree(tkey, count)
      local total, low = tds_tree_root(t)
      if total <= 0 then
        do return {'WAIT', 'weight', 'no written slot has a positive priority'} end
      end
      low_prob = tds_f64_pack(low / total)
      mass = tds_f64_pack(total)
      if policy.mt ~= nil then
        tds_times_check(times_key, count)
      end
      for j = 1, n do
        if total <= 0 then
          break  -- every slot retired: a shorter batch
        end
        local s = tds_tree_draw(t, tds_u64(draws, 8 * j - 7) / 9007199254740992 * total, total)
        if s == nil then
          break
        end
        rows[#rows + 1] = s
        packed[#packed + 1] = tds_p64(s)
        probs[#probs + 1] = tds_f64_pack(tds_tree_leaf(t, s) / total)
        if policy.mt ~= nil then
          counted[s] = (counted[s] or tds_times(times_key, s)) + 1
          if counted[s] >= policy.mt then
            tds_tree_set(t, {[s] = 0})  -- retired (in this call's view of the tree at once): never drawn again until rewritten
            total = tds_tree_root(t)
          end
        end
      end
      finish[#finish + 1] = function()
        tds_tree_flush(t)
        for s, c in pairs(counted) do
          redis.call('SETRANGE', times_key, 4 * s, tds_times_bytes(c))
        end
      end
    else
      for j = 1, n do
        rows[j] = tds_held_slot(tds_u64(draws, 8 * j - 7), written, from, count)
        packed[j] = tds_p64(rows[j])
      end
    end
    if lim ~= nil or policy.mt ~= nil then  -- a sample that counts: what a resend gets back
      decision = by_priority and 'P' .. low_prob .. mass .. table.concat(packed) .. table.concat(probs) or 'U' .. string.format('%.0f', written) .. (from and string.format('@%.0f', from) or '')
    end
    if tds_stats.key ~= nil then
      finish[#finish + 1] = function() tds_stat_sample(rows, rw, count) end
    end
    if lim ~= nil then
      local drawn = #rows
      finish[#finish + 1] = function()
        redis.call('HINCRBY', meta, 'sn', drawn)
        if channel ~= '' then
          redis.call('PUBLISH', channel, 's')  -- writers held by the limiter may go on
        end
      end
    end
    out[#out + 1] = table.concat(packed)
    out[#out + 1] = string.format('%.0f', rw)
    out[#out + 1] = table.concat(probs)
    out[#out + 1] = low_prob .. mass
  elseif kind == 'F' then
    -- pop: the next unread items in write order, each to exactly one reader
    if rows ~= nil then
      error('TDSTORE bad argument: one U, P or F op per call')
    end
    local n = tds_num(ARGV[a + 1], 'row count')
    local channel = ARGV[a + 2]
    a = a + 3
    local head = redis.call('HMGET', meta, 'count', 'rw', 'rr')
    local count, rw = tds_ring_fields(head[1], head[2])
    rw = tds_ring_rw(meta, count, rw)
    ring_count = count
    local rr = tds_int_field(head[3], 'rr', 0, rw, 0)
    if rw - rr > count then
      -- writers lapped unread items: skip to the oldest item still there, and say how many were lost.
      -- The ops after this one still read that item (not sent back), so a 'count' edited by hand
      -- is found (tds_count_agrees) before the cursor moves.
      lost_reply = {'LOST', string.format('%.0f', rw - count - rr)}
      decision = 'L' .. string.format('%.0f', rw - count - rr)
      rows = {(rw - count) % count}
      finish[#finish + 1] = function()
        tds_stat('lost', rw - count - rr)
        redis.call('HSET', meta, 'rr', string.format('%.0f', rw - count))
        if channel ~= '' then
          redis.call('PUBLISH', channel, 'p')
        end
      end
    elseif rw == rr then
      do return {'WAIT', 'empty', 'no unread item'} end
    end
    local k = lost_reply and 0 or math.min(n, rw - rr)
    if not lost_reply then
      decision = 'F' .. string.format('%.0f', rr) .. ' ' .. string.format('%.0f', k)
    end
    rows = lost_reply and rows or {}
    local packed = {}
    for j = 1, k do
      rows[j] = (rr + j - 1) % count
      packed[j] = tds_p64(rows[j])
    end
    if not lost_reply then
      finish[#finish + 1] = function()
        tds_stat('pop', k)
        tds_stat('hp_ms', tds_stats.held)
        redis.call('HSET', meta, 'rr', string.format('%.0f', rr + k))
        if channel ~= '' then
          redis.call('PUBLISH', channel, 'p')  -- writers of a full queue may go on
        end
      end
    end
    out[#out + 1] = table.concat(packed)
    out[#out + 1] = string.format('%.0f', rw)
  elseif kind == 'L' then
    -- leased pop (see _lease.lua): expired leases' items first, then unread items, in write order
    if rows ~= nil then
      error('TDSTORE bad argument: one U, P, F or L op per call')
    end
    local n, channel = tds_num(ARGV[a + 1], 'row count'), ARGV[a + 2]
    local ms, id = tds_num(ARGV[a + 3], 'lease'), ARGV[a + 4]
    local K = tds_lease.keys(ARGV, a + 5)
    a = a + 10
    tds_lease.check_receipt(id)
    if n < 1 or n ~= math.floor(n) or ms < 0 or ms ~= math.floor(ms) then
      error('TDSTORE bad argument: a leased pop of ' .. tostring(n) .. ' items for ' .. tostring(ms) .. ' ms')
    end
    local head = redis.call('HMGET', meta, 'count', 'rw', 'rr', 'ls', 'kv')
    local count, rw = tds_ring_fields(head[1], head[2])
    rw = tds_ring_rw(meta, count, rw)
    ring_count = count
    local rr = tds_int_field(head[3], 'rr', 0, rw, 0)
    local kv = tds_int_field(head[5], 'kv', 0, TDS_MAXINT, 1)
    local now = tds_lease.now_ms()
    local ws, counts, deadline = {}, {}, 0
    local state, had = tds_lease.record(K, id)
    if state == 'A' then
      error('TDSTORE refused: the pop with receipt ' .. id .. ' was acknowledged already')
    end
    if state == 'L' or state == 'S' then
      -- a resend of a pop that ran (its reply was lost): the same items again, nothing taken
      local lost = {}
      local ds = state == 'L' and tds_lease.items(K, had) or {}
      for j, w in ipairs(had) do
        if w < rw - count then
          lost[#lost + 1] = w
        else
          ws[#ws + 1] = w
          counts[#counts + 1] = ds[j] or 1
        end
      end
      if #lost > 0 then
        if state == 'L' then
          tds_lease.drop(K, lost)
        end
        tds_lease.set_record(K, id, state, ws)
        tds_lease.settle(meta, K, channel)
        do return {'LOST', tds_lease.fmt(#lost)} end
      end
      if state == 'L' then
        deadline = tonumber(redis.call('ZSCORE', K.d, id) or '0')
      end
    else
      local reclaimed = tds_lease.reclaim(K, now)
      tds_stat('exp', reclaimed)  -- written already, as the reclaim is
      local lost = tds_lease.drop_lost(K, rw, count)
      if rw - rr > count then
        -- writers lapped unread items: skip to the oldest item still there, as 'F' does
        lost = lost + rw - count - rr
        rr = rw - count
        redis.call('HSET', meta, 'rr', tds_lease.fmt(rr))
      end
      if lost > 0 then
        tds_lease.settle(meta, K, channel)
        tds_stat('lost', lost)
        do return {'LOST', tds_lease.fmt(lost)} end
      end
      local waiting = redis.call('ZRANGE', K.q, 0, n - 1)
      for j = 1, #waiting do
        ws[j] = tonumber(waiting[j])
      end
      local ds = tds_lease.items(K, ws)
      for j = 1, #ws do
        counts[j] = (ds[j] or 0) + 1
      end
      local redelivered = #ws
      local fresh = math.min(n - redelivered, rw - rr)
      for j = 0, fresh - 1 do
        ws[#ws + 1] = rr + j
        counts[#counts + 1] = 1
      end
      if #ws == 0 then
        if reclaimed > 0 then
          tds_lease.settle(meta, K, '')
        end
        do return {'WAIT', 'empty', 'no unread item, and no lease has expired'} end
      end
      if ms > 0 then
        deadline = now + ms
      end
      if not head[4] then
        kv = kv + 1
      end
      finish[#finish + 1] = function()
        if state == 'X' then
          redis.call('ZREM', K.k, id)  -- the receipt of a lease that expired before its resend: reused
        end
        if ms == 0 then
          tds_lease.drop(K, ws)  -- settled: a plain pop promises at most once
        else
          tds_lease.set_items(K, ws, counts, id)
          local again, fresh_ws = {}, {}
          for j = 1, #ws do
            if j <= redelivered then
              again[#again + 1] = tds_lease.fmt(ws[j])
            else
              fresh_ws[#fresh_ws + 1] = ws[j]
            end
          end
          tds_lease.batch('ZREM', K.q, again)
          tds_lease.zadd(K.o, fresh_ws)
        end
        if ms > 0 then
          tds_lease.set_record(K, id, 'L', ws)
          redis.call('ZADD', K.d, deadline, id)
        else
          tds_lease.set_record(K, id, 'S', ws)
          tds_lease.tombstone(K, id, now)
        end
        if fresh > 0 then
          redis.call('HSET', meta, 'rr', tds_lease.fmt(rr + fresh))
        end
        tds_stat('pop', #ws)
        tds_stat('hp_ms', tds_stats.held)
        tds_stat('rdl', redelivered)
        if not head[4] then
          redis.call('HSET', meta, 'ls', '1')
          redis.call('HINCRBY', meta, 'kv', 1)
        end
        tds_lease.settle(meta, K, channel)
      end
    end
    rows = {}
    local slots, wpack, cpack = {}, {}, {}
    for j = 1, #ws do
      rows[j] = ws[j] % count
      slots[j] = tds_p64(rows[j])
      wpack[j] = tds_p64(ws[j])
      cpack[j] = tds_p64(counts[j])
    end
    out[#out + 1] = table.concat(slots)
    out[#out + 1] = tds_lease.fmt(rw)
    out[#out + 1] = table.concat(wpack)
    out[#out + 1] = table.concat(cpack)
    out[#out + 1] = tds_lease.fmt(deadline) .. ' ' .. tds_lease.fmt(kv)
  elseif kind == 'H' then
    length_leaf = {ko = tds_num(ARGV[a + 1], 'key index'), ks = tds_num(ARGV[a + 2], 'key index'),
                   rec = tds_num(ARGV[a + 3], 'record size'), isz = tds_num(ARGV[a + 4], 'item size')}
    a = a + 5
  elseif kind == 'G' then
    -- rollouts (see _rollouts.lua): visible rows or whole groups, fresh enough, sampled or popped
    if rows ~= nil then
      error('TDSTORE bad argument: one U, P, F, L, J or G op per call')
    end
    local head = redis.call('HMGET', meta, 'count', 'rw')
    local count, rw = tds_ring_fields(head[1], head[2])
    rw = tds_ring_rw(meta, count, rw)
    ring_count = count
    local sampling = ARGV[a + 1] == 's'
    local got = tds_ro.pick(meta, a, count, rw, request, seg_per, length_leaf)
    a = a + 14
    if got.reply then
      if sampling then
        tds_stat('hr', 1)
      end
      do return got.reply end
    end
    rows = got.rows
    decision = got.decision
    if got.finish then
      finish[#finish + 1] = got.finish
    elseif sampling and tds_stats.key ~= nil then
      finish[#finish + 1] = function() tds_stat_sample(rows, rw, count); tds_ro.count_age(got) end
    end
    out[#out + 1] = table.concat(got.slots)
    out[#out + 1] = string.format('%.0f', rw)
    out[#out + 1] = table.concat(got.versions)
    out[#out + 1] = table.concat(got.sizes)
    out[#out + 1] = string.format('%.0f %.0f', got.skipped, got.lost)
  elseif kind == 'I' then
    -- rows named by the client (a scattered batch): decoded once, then read by each 'X' op
    local n = tds_num(ARGV[a + 1], 'row count')
    local packed = ARGV[a + 2]
    a = a + 3
    if #packed ~= 8 * n then
      error('TDSTORE bad argument: row table size')
    end
    rows = {}
    for j = 1, n do
      rows[j] = tds_u64(packed, 8 * j - 7)
    end
  elseif kind == 'X' or kind == 'B' then
    if rows == nil then
      error('TDSTORE bad argument: X op before its U or I op')
    end
    local ki = tds_num(ARGV[a + 1], 'key index')
    local nb = tds_num(ARGV[a + 2], 'element size')
    a = a + 3
    local pieces = {}
    if nb > 0 then
      local cache = kind == 'B' and {} or nil
      local j, m = 1, 0
      while j <= #rows do
        local seg, row = tds_locate(rows[j], seg_per)
        if ring_count ~= nil then
          tds_count_agrees(counted_keys, tds_segkey(ki, seg), ring_count, seg_per, seg, nb, 0)
        end
        local k = j  -- consecutive rows of one segment (a slice's, 'J'): one GETRANGE
        while cache == nil and k < #rows and rows[k + 1] == rows[k] + 1 and tds_locate(rows[k + 1], seg_per) == seg do
          k = k + 1
        end
        m = m + 1
        pieces[m] = seg_range(cache, ki, seg, row * nb, nb * (k - j + 1))
        j = k + 1
      end
    end
    out[#out + 1] = table.concat(pieces)
  elseif kind == 'Y' or kind == 'V' then
    if rows == nil then
      error('TDSTORE bad argument: Y op before its U or I op')
    end
    local dk = tds_num(ARGV[a + 1], 'data key index')
    local ok = tds_num(ARGV[a + 2], 'offset key index')
    local sk = tds_num(ARGV[a + 3], 'shape key index')
    local rec = tds_num(ARGV[a + 4], 'record size')
    a = a + 5
    local bounds, shapes, data = {}, {}, {}
    local otabs = kind == 'V' and {} or nil
    local stabs = kind == 'V' and {} or nil
    for j = 1, #rows do
      local seg, row = tds_locate(rows[j], seg_per)
      if ring_count ~= nil then
        tds_count_agrees(counted_keys, tds_segkey(ok, seg), ring_count, seg_per, seg, 8, 1)
      end
      local offs = seg_range(otabs, ok, seg, 8 * row, 16)
      bounds[j] = offs
      if rec > 0 then
        shapes[j] = seg_range(stabs, sk, seg, row * rec, rec, false, rec)
      end
      local first, last = tds_u64(offs, 1), tds_u64(offs, 9)
      tds_bounds_rise(tds_segkey(ok, seg), first, last, row)
      data[j] = last > first and seg_range(nil, dk, seg, first, last - first, true) or ''
    end
    out[#out + 1] = table.concat(bounds)
    out[#out + 1] = table.concat(shapes)
    out[#out + 1] = table.concat(data)
  elseif kind == 'T' then
    out[#out + 1] = redis.call('GET', KEYS[tds_num(ARGV[a + 1], 'key index')]) or ''
    a = a + 2
  elseif kind == 'Q' then
    seg_per = tds_segment_length(a, rows)
    a = a + 2
  else
    error('TDSTORE bad argument: unknown read op ' .. tostring(kind))
  end
end
if decision ~= nil then
  tds_remember(request, decision)  -- first: at maxmemory the call is refused before it changes anything
end
for _, change in ipairs(finish) do
  change()
end
return lost_reply or out
