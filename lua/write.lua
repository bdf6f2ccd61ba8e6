--[[
  write.lua: write element bytes, whole blobs and tables of several leaves, and
  optionally swap in a new schema, as one atomic step.

  Serves store[i] = td, store[i].update(td), slice / step / index / mask writes,
  set() of a new or replaced key, del, rename and shape-changing writes. A
  heterogeneous element whose size changes is spliced into its blob and the
  offset table behind it is rewritten here, on the server: the client never reads,
  patches and writes back. Every argument is parsed, and the size every string
  will have is checked against the server's limit, before the first write: a call
  either writes everything or nothing. The common in-place write (store[i] = td of existing
  keys) takes a short path first (in_place, below), with the same checks and outcome.

  KEYS[1]     store header hash
  KEYS[2]     the store's inventory hash when the header has the field 'na' (see _lib.lua)
  KEYS[2..]   data / offset / shape keys touched, and the reply cache of an 'N' op, referenced by index

  ARGV[1]     '<epoch>:V<version>' for a schema change (it rewrites the whole schema,
              so it must be planned from the current one), else '<epoch>:*'
  ARGV[2]     'number:version' of every leaf written (see tds_check in _lib.lua)
  ARGV[3]     new schema JSON to store (bumps 'version'), or '' to keep the schema
  ARGV[4]     with a new schema: the guard fields it sets, 'name=value' words
              ('kv=7 lv:3=7 lv:5=-'; '-' deletes the field)
  ARGV[5]     the largest string the server accepts, in bytes (proto-max-bulk-len,
              or less on servers with a lower SETRANGE cap)
  ARGV[6]     what each key holds (tdstore/_format/integrity.py): per KEYS index i, 24 bytes at
              24 * (i - 1): three little-endian int64 (code, length, aux). code 0: not
              checked; 1: a heterogeneous leaf's data, at least as long as the last
              offset of its offset table KEYS[aux]; 2: exactly 'length' bytes (aux: a
              shape table's record size, for the empty records it is allocated with). Before
              the first write, every key an op writes in place (not a key the call sets,
              allocates or deletes whole) is checked; a key the inventory says was never
              allocated is allocated (zeros) first; any other mismatch refuses the call.
  ARGV[7]     number of ops, then each op. The client declares each kind once, in
              tdstore/_format/op_kinds.py (class Write: its arguments, which are KEYS indices, and
              which keys it writes); a new kind is an entry there and its parser here:
    'R', k, n, ranges, data
          n SETRANGEs into KEYS[k]: 'ranges' packs n pairs (start, length) as
          little-endian int64, 'data' holds the n values back to back
    'S', k, bytes                                        SET KEYS[k] (a new blob or table)
    'D', k                                               DEL KEYS[k]
    'T', k                                               KEYS[k] is kept as it is, but checked (and
                                                         allocated when never written) as a key
                                                         written in place: a homogeneous leaf that
                                                         turns heterogeneous keeps its blobs
    'Z', k, n                                            KEYS[k] becomes n zero bytes, allocated
                                                         by the server (nothing sent)
    'M', ks, kt, n
          move the staging key KEYS[ks] (filled with plain SETRANGEs in the same
          pipeline, n bytes) onto KEYS[kt] (RENAME, then PERSIST): a large blob is
          replaced without pushing its bytes through Lua
    'O', ks, kd
          KEYS[kd] becomes a copy of KEYS[ks] (COPY on the server; deleted when KEYS[ks]
          does not exist): a spread store's schema change writes a copy of each key it
          would change in place, so the change appears at its commit (see tdstore/_engine/spread_change.py)
    'C', kb, kd, stride, col, nb
          KEYS[kd] becomes the column of the row block KEYS[kb] whose rows are
          stride bytes: nb bytes at col of every row, back to back (a leaf leaving
          the block gets a blob of its own, built on the server)
    'F', kd, ko, a, b, pattern
          fill with 'pattern' repeated: bytes a..b-1 of KEYS[kd] when ko = 0 (a
          homogeneous leaf), else the bytes of elements a..b (0-based, inclusive) of
          the heterogeneous leaf whose offset table is KEYS[ko]: zero_ and fill_
          without reading or sending the data
    'E', kd, ko, ks, rec, lo, hi, shapes, data, size_lo, ..., size_hi
          replace elements lo..hi (0-based, inclusive) of a heterogeneous leaf by
          'data' (their bytes back to back, sizes given) and their shape records by
          'shapes' (rec bytes each); when the sizes change, the bytes after the run
          move and every later offset is shifted: O(count - lo) work. A one-dim leaf
          (rec 8) whose sizes stay the same keeps its shape records: they follow
          from the sizes, so they are already the ones given.

    'W', n, channel
          reserve the next n slots of the ring (the store's count is its capacity):
          value row j goes to slot (rw + j) % count, where rw is the header's ring
          write counter, which grows by n. Must come before the 'X'/'Y' ops it
          addresses; n may not exceed the count (no slot twice in one call). Under a
          sampling policy (header field 'sc', see sampling.lua) the write waits (reply
          WAIT, nothing written) while the rate limiter holds inserts or, in queue mode,
          while it would overwrite items no one has popped (or acknowledged, when leased:
          header field 'lo', see _lease.lua). After writing, it publishes
          on the Pub/Sub 'channel' ('' for none), so waiting clients wake.
    'P', kt, kc, priorities
          after 'W', on a store with priorities: the tree KEYS[kt] and sample counts
          KEYS[kc] (see _tree.lua); 'priorities' holds one priority per row as decimal
          text ('' gives every row the largest priority so far, header field 'pm'). Each
          slot written weighs priority ^ alpha, and its sample count restarts at 0.
    'J', kj, ids
          after 'W', on a ring with trajectories (header field 'tj', see trajectories.lua): each
          row's trajectory id (8 bytes, little-endian int64) or end flag (1 byte), by what 'tj'
          says; the episode index KEYS[kj] is kept in the same call (_episodes.lua). A ring
          write without it on such a ring answers STALE (planned before the setting).
    'G', n, pairs
          conditional rows: 'pairs' packs n (slot, generation) int64 pairs; value
          row j goes to its slot only when the slot's generation (see below) still
          equals the one given, else row j is skipped.
    'V', kz, kr, kg, ks, kq, version, max_ahead, group, size
          after 'W', on a ring with rollouts (see _rollouts.lua, keys KEYS[kz..kq]): stamps
          the rows with 'version' ('' : the published one, header field 'cv'); with
          max_ahead, a version more than that ahead of 'cv' waits (reply WAIT, nothing
          written); with 'group' (an id) the rows join that group of 'size' rows, invisible
          until it is whole (a group of another size, or one that would overflow, is refused
          before any write). Turns the index on (header 'ro'; 'kv' and 'version' + 1) on first use.
    'X', k, nb, data
          a homogeneous leaf, addressed by the rows of 'W' or 'G': 'data' holds one
          nb-byte element per row; consecutive slots become one SETRANGE.
    'K', k, nb, stride, col, data
          one column of the row block (see tdstore/_format/row_block.py), addressed by the rows of
          'W' or 'G': 'data' holds one nb-byte element per row, written at
          row * stride + col (one SETRANGE per row)
    'Y', kd, ko, ks, rec, shapes, data, size_1, ..., size_n
          a heterogeneous leaf addressed by rows: one element per row (its bytes in
          'data', its shape record in 'shapes'), spliced like 'E' per run of
          consecutive slots.
    'A', k, ms
          count this call's ring work in the store's stats hash KEYS[k] (see tds_stat in
          _lib.lua; before the 'W' op): rows written by the ring ('ins'), WAIT replies
          of ring writes held back by the rate limiter or a full queue ('hw'), and the ms
          the client's call was held back before this try, once it goes through ('hw_ms');
          rows it overwrote, sampled or not ('ovs', 'ovu'), their bits cleared in the
          sampled-rows bitmap KEYS[k + 1] (see _seen.lua)
    'N', k, rid
          the call's request id (must be the first op; a ring write, update_if, or a key
          renamed or deleted): KEYS[k] is the store's reply cache (see tds_request in
          _lib.lua). Before the version check, an id recorded by an earlier attempt gets
          that attempt's reply back ({'OK', version, rw before it}, {'OK', version,
          applied}, or {'OK', version} for a rename or delete) and nothing is written;
          otherwise the reply's third item (or 'S') is recorded under the id.
    'B', k
          KEYS[k] is the store header (KEYS[1]): its field 'tr', the count of in-place
          writes through torchrl (tdstore/_ring/marks.py), grows by 1 with the write, so
          the rows and the revision that other processes' cached samplers read move together.
          A plain element write carries no request id: a resend of it writes the same bytes
          again and moves 'tr' twice, which is harmless (a revision only has to change).
    'Q', per
          the store is cut into segments of 'per' elements (must come before 'W'/'G'):
          the key indices of the 'X'/'Y' ops after it each name the first of a block
          of consecutive KEYS, one per segment, and row r goes to segment
          floor(r / per) at index r % per; a run of slots never crosses a segment.
          The generation of slot s is the number of ring writes ('W') it received:
          0 when s >= rw, else floor((rw - 1 - s) / count) + 1. A store holding
          data the ring never wrote (written by index) is a full ring, rw = count
          (tds_ring_rw in _lib.lua): its first 'W' overwrites slot 0 and sets rw past it.

  Reply       {'OK', version} with the version now current; with a 'W' op
              {'OK', version, rw before the call}; with a 'G' op
              {'OK', version, applied} where 'applied' has one '1' or '0' per row.
              When the store has a time to live, every key the call creates
              gets the header's expiry, so the keys of a store expire together.
              {'STALE', header field, value, ...} when a checked version moved: nothing written.
              {'GONE'} when the store does not exist: nothing written.
              {'WAIT', reason, message} when the sampling policy holds a ring write back:
              nothing written (the client waits for a message on the channel, then tries again).
  Errors      'TDSTORE bad argument' for a malformed op, 'TDSTORE too large' when a
              string would outgrow ARGV[5], 'TDSTORE damaged' when a key the call writes
              in place is lost or short or a header field or tree value a ring write reads is
              out of range, 'TDSTORE out of memory' when the bytes the call
              allocates would take the server past its maxmemory once the call's own
              arguments are freed (tds_room in _lib.lua; all raised before any write).
]]
local meta = KEYS[1]
-- a resent ring write (its request id recorded, see tds_request): the first reply, nothing written
local request = nil
if ARGV[8] == 'N' then
  request = tds_request(ARGV[9], ARGV[10])
  local seen = request.seen
  if seen then
    local version = redis.call('HGET', meta, 'version')
    if not version then
      return {'GONE'}
    end
    local what = string.sub(seen, 1, 1)
    if what == 'S' then  -- a schema change (a key renamed or deleted): applied once, by the first attempt
      return {'OK', version}
    end
    return {'OK', version, what == 'G' and tds_unruns(string.sub(seen, 2)) or string.sub(seen, 2)}
  end
end
local bad, version = tds_check(meta, ARGV[1], ARGV[2])
if bad then
  return bad
end
if ARGV[3] ~= '' and not string.find(ARGV[1], ':V', 1, true) then
  error('TDSTORE bad argument: a schema change must check the exact version')
end

-- Whether elements lo..hi of a heterogeneous leaf keep their sizes: 'offs' holds their offsets
-- (8 * (hi - lo + 2) bytes), 'sizes' the new sizes in order.
local function sizes_kept(offs, sizes)
  for j = 1, #sizes do
    if tds_u64(offs, 8 * j + 1) - tds_u64(offs, 8 * j - 7) ~= sizes[j] then
      return false
    end
  end
  return true
end

-- The common write, in a short path: store[i] = td (or a slice) of existing keys, every byte
-- written where it already is ('R' ops, 'E' ops whose elements keep their sizes, 'B'). It
-- checks what pass 1 checks for such ops, in fewer commands, and writes only when every op
-- qualifies and every key is as the header implies; anything else (another op, a key to
-- allocate, a damaged key, an element changing size, a malformed op) returns nil before any
-- write and goes through the passes below, which word the errors. It saves an element write
-- about a third of its server time: pass 1's tables and closures, and repeated commands.
local function in_place()
  if ARGV[3] ~= '' or request ~= nil then
    return nil
  end
  local checks, writes, lens, counts = ARGV[6], {}, {}, false
  -- the length of KEYS[n] when it holds what the header implies (ARGV[6]), else nil
  local function length(n)
    local have = lens[n]
    if have ~= nil or KEYS[n] == nil then
      return have
    end
    local code, want, aux = tds_expected(checks, n)
    if code ~= 1 and code ~= 2 then
      return nil
    end
    have = redis.call('STRLEN', KEYS[n])
    if code == 1 then
      local olen = length(aux)
      if have == 0 or olen == nil or have < tds_last_offset(olen, function(from, to) return redis.call('GETRANGE', KEYS[aux], from, to) end) then
        return nil
      end
    elseif have ~= want or have == 0 then
      return nil
    end
    lens[n] = have
    return have
  end
  local a = 8
  for _ = 1, tonumber(ARGV[7]) or 0 do
    local kind = ARGV[a]
    if kind == 'R' then
      local n, count, ranges, data = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), ARGV[a + 3], ARGV[a + 4]
      local have = n and length(n)
      if have == nil or count == nil or #ranges ~= 16 * count then
        return nil
      end
      local pos = 1
      for j = 0, count - 1 do
        local start, len = tds_u64(ranges, 16 * j + 1), tds_u64(ranges, 16 * j + 9)
        if start + len > have then
          return nil
        end
        if len > 0 then
          writes[#writes + 1] = {KEYS[n], start, count == 1 and data or tds_part(data, pos, pos + len - 1)}
        end
        pos = pos + len
      end
      if pos - 1 ~= #data then
        return nil
      end
      a = a + 5
    elseif kind == 'E' then
      local d, o, sk = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
      local rec, lo, hi = tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5]), tonumber(ARGV[a + 6])
      local shapes, data = ARGV[a + 7], ARGV[a + 8]
      if not (d and o and sk and rec and lo and hi) or hi < lo or #shapes ~= rec * (hi - lo + 1) or length(d) == nil or length(o) == nil then
        return nil
      end
      local offs = redis.call('GETRANGE', KEYS[o], 8 * lo, 8 * (hi + 2) - 1)
      if #offs ~= 8 * (hi - lo + 2) then
        return nil
      end
      local sizes, total = {}, 0
      for j = 1, hi - lo + 1 do
        sizes[j] = tonumber(ARGV[a + 8 + j])
        if sizes[j] == nil then
          return nil
        end
        total = total + sizes[j]
      end
      if total ~= #data or not sizes_kept(offs, sizes) then
        return nil  -- a size changes: pass 2 moves the bytes after it
      end
      if total > 0 then
        writes[#writes + 1] = {KEYS[d], tds_u64(offs, 1), data}
      end
      if rec > 8 then  -- one dim: the same sizes are the same shapes (see the 'E' op)
        local have = length(sk)
        if have == nil or (hi + 1) * rec > have then
          return nil
        end
        writes[#writes + 1] = {KEYS[sk], lo * rec, shapes}
      end
      a = a + 9 + (hi - lo + 1)
    elseif kind == 'B' and KEYS[tonumber(ARGV[a + 1]) or 0] == meta then
      if not pcall(tds_int_field, redis.call('HGET', meta, 'tr'), 'tr', 0, TDS_MAXINT, 0) then
        return nil  -- damaged: pass 1 refuses it, naming the field
      end
      counts = true
      a = a + 2
    else
      return nil
    end
  end
  return writes, counts
end
local quick, counts = in_place()
if quick ~= nil then
  -- at maxmemory the first SETRANGE is refused before anything changed; an in-place SETRANGE allocates nothing
  for _, w in ipairs(quick) do
    redis.call('SETRANGE', w[1], w[2], w[3])
  end
  if counts then
    redis.call('HINCRBY', meta, 'tr', 1)
  end
  return {'OK', version}
end
-- tds:rest
-- (the helpers only the passes below use are made here: see tdstore/_engine/script_text.py)

-- pass 1: parse and check every op
local ops = {}
local limit = tds_num(ARGV[5], 'size limit')
local checks = ARGV[6]
local nops = tds_num(ARGV[7], 'op count')
local a = 8
local inplace = {}  -- KEYS index -> true: a key an op writes in place (checked before any write)
local whole = {}  -- KEYS index -> true: a key an op sets, allocates or deletes whole
local grow = {}  -- data key -> bytes its heterogeneous splices add (checked below)
local pending = {}  -- key -> value an earlier 'S' op of this call will set
-- GETRANGE as it will read once the earlier 'S' ops of this call have run
local function peek(k, from, to)
  local v = pending[k]
  if v ~= nil then
    return string.sub(v, from + 1, to + 1)
  end
  return redis.call('GETRANGE', k, from, to)
end
local lens = {}  -- key -> its STRLEN: pass 1 writes nothing, so each key is asked once
local function peek_len(k)
  local v = pending[k]
  if v ~= nil then
    return #v
  end
  local n = lens[k]
  if n == nil then
    n = redis.call('STRLEN', k)
    lens[k] = n
  end
  return n
end
local function too_large(key, size)
  error('TDSTORE too large: ' .. key .. ' would hold ' .. string.format('%.0f', size) .. ' bytes, more than the server accepts (' .. string.format('%.0f', limit) .. ')')
end
-- Check, before anything is written, that KEYS[n] holds what the header implies (ARGV[6]); a
-- key never allocated is queued to be allocated (zeros) and reads as zeros from here on.
local allocate, allocated = {}, 0  -- keys allocated before the ops run, and the bytes this call allocates
local checked, fresh = {}, {}
local function need(n)
  if checked[n] or whole[n] then
    return
  end
  checked[n] = true
  local code, want, aux = tds_expected(checks, n)
  if code == nil then
    error('TDSTORE bad argument: no check for key ' .. n)
  end
  if code == 0 then
    return
  end
  local k = KEYS[n]
  local have = peek_len(k)
  if have == 0 then
    fresh[#fresh + 1] = k  -- a SETRANGE may create it: it gets the store's deadline below
  end
  if code == 1 then
    need(aux)
    local okey = KEYS[aux]
    local olen = peek_len(okey)
    local last = tds_last_offset(olen, function(from, to) return peek(okey, from, to) end)
    if have < last then
      tds_short(k, have, last, true)
    end
    return
  end
  if have == want then
    return
  end
  if have == 0 and tds_unallocated(meta, k) then
    allocate[#allocate + 1] = {k, want, aux}  -- aux: a shape table's record size
    allocated = allocated + want
    if want <= 1048576 then
      pending[k] = tds_blank(meta, want, aux)  -- what a table peeked at below reads
    end
    return
  end
  tds_short(k, have, want, false)
end
local function key(i, mark)
  local n = tds_num(ARGV[i], 'key index')
  local k = KEYS[n]
  if k == nil then
    error('TDSTORE bad argument: key index out of range')
  end
  if mark == whole then
    whole[n] = true
  elseif mark == inplace then
    need(n)
  end
  return k
end
-- rows of this call's 'X'/'Y' ops, set by its 'W' or 'G' op, and the runs {first, last} of
-- consecutive row positions whose rows are applied and sit in consecutive slots: each run is
-- one SETRANGE ('X') or one splice ('Y')
local rows, applied, runs, ring_n, extra = nil, nil, nil, 0, nil
local ring_from = 0  -- what a W op adds to 'rw' before its rows (see tds_ring_rw in _lib.lua)
local ring_rw0, trajectories, episodes = 0, nil, nil  -- a W op's first write number; 'tj'; a 'J' op's index and ids
-- a ring write's sampling policy (header field 'sc'), the priorities its 'P' op gives,
-- the largest priority so far ('pm'), and the channel it publishes on
local policy, prio, top_priority, channel = nil, nil, nil, nil
local seg_per = nil  -- elements per segment, set by a 'Q' op
local count_in_place = false  -- a 'B' op: the header's 'tr' + 1 with the write
local ring_count, counted_keys = nil, {}  -- the count a 'W' or 'G' op's slots are modulo, and the keys checked against it
local rollout = nil  -- a 'V' op's stamp (see _rollouts.lua), applied after the rows are written
local function row_runs()
  local out, j = {}, 1
  while j <= #rows do
    if applied[j] then
      local e = j
      while e < #rows and applied[e + 1] and rows[e + 1] == rows[e] + 1 and (seg_per == nil or rows[e + 1] % seg_per ~= 0) do
        e = e + 1
      end
      out[#out + 1] = {j, e}
      j = e + 1
    else
      j = j + 1
    end
  end
  return out
end
-- Check an 'E' op (sizes, range, the size its blob will have) and queue it.
local function add_splice(op)
  local total = 0
  for j = 1, #op.sizes do
    total = total + op.sizes[j]
  end
  if #op.sizes ~= op.hi - op.lo + 1 or total ~= #op.data or #op.shapes ~= op.rec * (op.hi - op.lo + 1) then
    error('TDSTORE bad argument: element sizes do not add up')
  end
  -- the blob grows by the new run's size minus the old one's: read (not write) the
  -- offsets now, so a blob that would outgrow the limit stops the call before any write
  local offs = peek(op.okey, 8 * op.lo, 8 * (op.hi + 2) - 1)
  if #offs ~= 8 * (op.hi - op.lo + 2) then
    error('TDSTORE bad argument: elements out of range of the offset table')
  end
  op.offs = offs  -- pass 2 reuses them unless an earlier op of the call wrote the table
  local same = sizes_kept(offs, op.sizes)
  op.same = same
  -- the shape records are written, so checked first, unless the leaf has one dim and every size stays
  if op.skn ~= nil and not (same and op.rec <= 8) then
    need(op.skn)
  end
  local g = grow[op.dkey]
  if g == nil then
    g = {delta = 0}
    grow[op.dkey] = g
  end
  g.delta = g.delta + total - (tds_u64(offs, 8 * (op.hi - op.lo + 1) + 1) - tds_u64(offs, 1))
  if g.delta > 0 then
    -- the blob grows: look up where it ends now (a same-size write never needs to)
    if g.end_ == nil then
      local olen = peek_len(op.okey)
      g.end_ = tds_u64(peek(op.okey, olen - 8, olen - 1), 1)
    end
    if g.end_ + g.delta > limit then
      too_large(op.dkey, g.end_ + g.delta)
    end
  end
  ops[#ops + 1] = op
end
for _ = 1, nops do
  local kind = ARGV[a]
  if kind == 'R' then
    local op = {kind = 'R', key = key(a + 1, inplace), n = tds_num(ARGV[a + 2], 'range count'), ranges = ARGV[a + 3], data = ARGV[a + 4]}
    if #op.ranges ~= 16 * op.n then
      error('TDSTORE bad argument: range table size')
    end
    local total = 0
    for j = 0, op.n - 1 do
      local len = tds_u64(op.ranges, 16 * j + 9)
      total = total + len
      if tds_u64(op.ranges, 16 * j + 1) + len > limit then
        too_large(op.key, tds_u64(op.ranges, 16 * j + 1) + len)
      end
    end
    if total ~= #op.data then
      error('TDSTORE bad argument: range lengths do not add up to the data')
    end
    a = a + 5
    ops[#ops + 1] = op
  elseif kind == 'S' then
    ops[#ops + 1] = {kind = 'S', key = key(a + 1, whole), value = ARGV[a + 2]}
    pending[ops[#ops].key] = ARGV[a + 2]
    a = a + 3
  elseif kind == 'M' then
    local op = {kind = 'M', src = key(a + 1), dst = key(a + 2, whole), n = tds_num(ARGV[a + 3], 'staged size')}
    if redis.call('STRLEN', op.src) ~= op.n then
      error('TDSTORE bad argument: the staged value is missing or incomplete')
    end
    if op.n > limit then
      too_large(op.dst, op.n)
    end
    a = a + 4
    ops[#ops + 1] = op
  elseif kind == 'D' then
    ops[#ops + 1] = {kind = 'D', key = key(a + 1, whole)}
    a = a + 2
  elseif kind == 'T' then
    key(a + 1, inplace)
    a = a + 2
  elseif kind == 'O' then
    local op = {kind = 'O', src = key(a + 1), key = key(a + 2, whole)}
    local v = pending[op.src]
    if v == nil then
      v = redis.call('GET', op.src) or ''
    end
    pending[op.key] = v  -- later ops of this call see the copy
    ops[#ops + 1] = op
    a = a + 3
  elseif kind == 'Z' then
    local op = {kind = 'Z', key = key(a + 1, whole), n = tds_num(ARGV[a + 2], 'size')}
    if op.n > limit then
      too_large(op.key, op.n)
    end
    pending[op.key] = nil
    ops[#ops + 1] = op
    a = a + 3
  elseif kind == 'C' then
    local op = {kind = 'C', src = key(a + 1, inplace), key = key(a + 2, whole), stride = tds_num(ARGV[a + 3], 'row size'),
                col = tds_num(ARGV[a + 4], 'column'), nb = tds_num(ARGV[a + 5], 'element size')}
    if op.stride < 1 or op.col + op.nb > op.stride then
      error('TDSTORE bad argument: column outside the row')
    end
    pending[op.key] = nil
    a = a + 6
    ops[#ops + 1] = op
  elseif kind == 'F' then
    local op = {kind = 'F', dkey = key(a + 1, inplace), a = tds_num(ARGV[a + 3], 'start'), b = tds_num(ARGV[a + 4], 'end'), pattern = ARGV[a + 5]}
    local ko = tds_num(ARGV[a + 2], 'offset key index')
    if ko > 0 then
      local okey = key(a + 2, inplace)
      local offs = peek(okey, 8 * op.a, 8 * (op.b + 2) - 1)
      if #offs ~= 8 * (op.b - op.a + 2) then
        error('TDSTORE bad argument: elements out of range of the offset table')
      end
      op.a, op.b = tds_u64(offs, 1), tds_u64(offs, #offs - 7)
    end
    if #op.pattern == 0 or (op.b - op.a) % #op.pattern ~= 0 then
      error('TDSTORE bad argument: the fill pattern does not tile the range')
    end
    if op.b > limit then
      too_large(op.dkey, op.b)
    end
    a = a + 6
    ops[#ops + 1] = op
  elseif kind == 'E' then
    local op = {kind = 'E', dkey = key(a + 1, inplace), okey = key(a + 2, inplace), skey = key(a + 3),
                skn = tds_num(ARGV[a + 3], 'key index'),  -- checked by add_splice when written
                rec = tds_num(ARGV[a + 4], 'record size'), lo = tds_num(ARGV[a + 5], 'lo'),
                hi = tds_num(ARGV[a + 6], 'hi'), shapes = ARGV[a + 7], data = ARGV[a + 8], sizes = {}}
    for j = 0, op.hi - op.lo do
      op.sizes[j + 1] = tds_num(ARGV[a + 9 + j], 'size')
    end
    a = a + 9 + (op.hi - op.lo + 1)
    add_splice(op)
  elseif kind == 'W' or kind == 'G' then
    if rows ~= nil then
      error('TDSTORE bad argument: one W or G op per call')
    end
    local n = tds_num(ARGV[a + 1], 'row count')
    local head = redis.call('HMGET', meta, 'count', 'rw', 'sc', 'sn', 'lb', 'rr', 'pm', 'lo', 'tj')
    local count, rw_raw = tds_ring_fields(head[1], head[2])
    local rw = tds_ring_rw(meta, count, rw_raw)
    ring_from = rw - rw_raw  -- a store filled by index: its first extend starts at rw = count
    ring_count = count
    rows, applied = {}, {}
    if kind == 'W' then
      if n < 1 or n > count then
        error('TDSTORE bad argument: a ring write of ' .. n .. ' rows into ' .. count .. ' slots')
      end
      channel = ARGV[a + 2]
      if head[3] then
        policy = tds_policy(head[3])
        local lim = policy.limit
        -- a batch goes when its first row may (Reverb counts row by row): it may overshoot by itself,
        -- and a writer and a sampler can never hold each other back for good
        if lim ~= nil and (rw - tds_int_field(head[5], 'lb', 0, rw, 0) + 1) * lim[1] - tds_int_field(head[4], 'sn', 0, TDS_MAXINT, 0) > lim[4] then
          tds_stat('hw', 1)
          do return {'WAIT', 'insert', 'the rate limiter holds inserts until the samplers catch up'} end
        end
        -- leased items not acknowledged yet (header field 'lo', see _lease.lua) count as unread
        local unread = tds_int_field(head[6], 'rr', 0, rw, 0)
        local oldest = head[8] and tds_int_field(head[8], 'lo', 0, TDS_MAXINT) or nil  -- the oldest leased item
        if oldest ~= nil then
          unread = math.min(unread, oldest)
        end
        if policy.queue and rw + n - unread > count then
          tds_stat('hw', 1)
          do return {'WAIT', 'full', 'the queue is full: writers wait until readers pop'} end
        end
        top_priority = tds_float_field(head[7], 'pm', 0, 1e300, 1)
      end
      for j = 1, n do
        rows[j] = (rw + j - 1) % count
        applied[j] = true
      end
      ring_n = n
      ring_rw0 = rw
      trajectories = head[9] or nil  -- (a missing field reads as false)
      extra = string.format('%.0f', rw)
      a = a + 3
    else
      local pairs_ = ARGV[a + 2]
      if #pairs_ ~= 16 * n then
        error('TDSTORE bad argument: row table size')
      end
      local flags = {}
      for j = 1, n do
        local s, want = tds_u64(pairs_, 16 * j - 15), tds_u64(pairs_, 16 * j - 7)
        if s >= count then
          error('TDSTORE bad argument: slot ' .. s .. ' out of range of ' .. count)
        end
        local gen = 0
        if s < rw then
          gen = math.floor((rw - 1 - s) / count) + 1
        end
        rows[j] = s
        applied[j] = gen == want
        flags[j] = applied[j] and '1' or '0'
      end
      extra = table.concat(flags)
      a = a + 3
    end
    runs = row_runs()
  elseif kind == 'X' then
    if rows == nil then
      error('TDSTORE bad argument: X op before its W or G op')
    end
    local ki, nb, data = tds_num(ARGV[a + 1], 'key index'), tds_num(ARGV[a + 2], 'element size'), ARGV[a + 3]
    if #data ~= nb * #rows then
      error('TDSTORE bad argument: row data size')
    end
    for _, run in ipairs(runs) do
      local j, e = run[1], run[2]
      local seg, row = tds_locate(rows[j], seg_per)
      local k = tds_segkey(ki, seg)
      tds_count_agrees(counted_keys, k, ring_count, seg_per, seg, nb, 0)
      need(ki + seg)
      local start = row * nb
      if start + (e - j + 1) * nb > limit then
        too_large(k, start + (e - j + 1) * nb)
      end
      if nb > 0 then
        ops[#ops + 1] = {kind = 'P', key = k, start = start, part = tds_part(data, (j - 1) * nb + 1, e * nb)}
      end
    end
    a = a + 4
  elseif kind == 'K' then
    if rows == nil then
      error('TDSTORE bad argument: K op before its W or G op')
    end
    local ki, nb, stride, col = tds_num(ARGV[a + 1], 'key index'), tds_num(ARGV[a + 2], 'element size'), tds_num(ARGV[a + 3], 'row size'), tds_num(ARGV[a + 4], 'column')
    local data = ARGV[a + 5]
    if #data ~= nb * #rows or col + nb > stride then
      error('TDSTORE bad argument: row data size')
    end
    for j = 1, #rows do
      if applied[j] and nb > 0 then
        local seg, row = tds_locate(rows[j], seg_per)
        local k = tds_segkey(ki, seg)
        tds_count_agrees(counted_keys, k, ring_count, seg_per, seg, stride, 0)
        need(ki + seg)
        local start = row * stride + col
        if start + nb > limit then
          too_large(k, start + nb)
        end
        ops[#ops + 1] = {kind = 'P', key = k, start = start, part = string.sub(data, (j - 1) * nb + 1, j * nb)}
      end
    end
    a = a + 6
  elseif kind == 'Y' then
    if rows == nil then
      error('TDSTORE bad argument: Y op before its W or G op')
    end
    local dk, ok, sk = tds_num(ARGV[a + 1], 'key index'), tds_num(ARGV[a + 2], 'key index'), tds_num(ARGV[a + 3], 'key index')
    local rec, shapes, data = tds_num(ARGV[a + 4], 'record size'), ARGV[a + 5], ARGV[a + 6]
    local n = #rows
    local sizes, starts, total = {}, {}, 0
    for j = 1, n do
      sizes[j] = tds_num(ARGV[a + 6 + j], 'size')
      starts[j] = total
      total = total + sizes[j]
    end
    if total ~= #data or #shapes ~= rec * n then
      error('TDSTORE bad argument: element sizes do not add up')
    end
    a = a + 7 + n
    for _, run in ipairs(runs) do
      local j, e = run[1], run[2]
      local seg, lo = tds_locate(rows[j], seg_per)
      tds_count_agrees(counted_keys, tds_segkey(ok, seg), ring_count, seg_per, seg, 8, 1)
      need(ok + seg)
      need(sk + seg)
      need(dk + seg)
      local op = {kind = 'E', dkey = tds_segkey(dk, seg), okey = tds_segkey(ok, seg), skey = tds_segkey(sk, seg), rec = rec, lo = lo, hi = lo + e - j,
                  shapes = tds_part(shapes, (j - 1) * rec + 1, e * rec),
                  data = tds_part(data, starts[j] + 1, starts[e] + sizes[e]), sizes = {}}
      for m = j, e do
        op.sizes[m - j + 1] = sizes[m]
      end
      add_splice(op)
    end
  elseif kind == 'P' then
    if ring_n == 0 then
      error('TDSTORE bad argument: P op before its W op')
    end
    prio = {tree = key(a + 1, whole), times = key(a + 2, whole), values = {}, weights = {}}
    local slots = tds_int_field(redis.call('HGET', meta, 'count'), 'count', 0, TDS_MAXINT)
    for v in string.gmatch(ARGV[a + 3], '%S+') do
      local p = tonumber(v)
      if p == nil or p < 0 or p ~= p or p >= 1e300 then
        error('TDSTORE bad argument: priority ' .. v)
      end
      prio.values[#prio.values + 1] = p
      if policy ~= nil and policy.alpha ~= nil then
        prio.weights[#prio.weights + 1] = tds_weight(p, policy.alpha, slots)
      end
    end
    if #prio.values ~= 0 and #prio.values ~= ring_n then
      error('TDSTORE bad argument: ' .. #prio.values .. ' priorities for ' .. ring_n .. ' rows')
    end
    a = a + 4
  elseif kind == 'J' then
    if ring_n == 0 then
      error('TDSTORE bad argument: J op before its W op')
    end
    episodes = {key = key(a + 1), ids = ARGV[a + 2]}
    a = a + 3
  elseif kind == 'V' then
    if ring_n == 0 then
      error('TDSTORE bad argument: V op before its W op')
    end
    rollout = tds_ro.parse_write(meta, a, tonumber(extra), ring_count, ring_n)
    if rollout.wait then
      tds_stat('hw', 1)
      do return rollout.wait end
    end
    a = a + 10
  elseif kind == 'Q' then
    seg_per = tds_segment_length(a, rows)
    a = a + 2
  elseif kind == 'N' then
    if a ~= 8 then
      error('TDSTORE bad argument: the N op comes first')
    end
    a = a + 3
  elseif kind == 'A' then
    key(a + 1)  -- (a key index in range)
    tds_stat_keys(tds_num(ARGV[a + 1], 'key index'), tds_num(ARGV[a + 2], 'held ms'))
    a = a + 3
  elseif kind == 'B' then
    if key(a + 1) ~= meta then
      error('TDSTORE bad argument: the B op names the store header')
    end
    tds_int_field(redis.call('HGET', meta, 'tr'), 'tr', 0, TDS_MAXINT, 0)  -- damaged: refused before any write
    count_in_place = true
    a = a + 2
  else
    error('TDSTORE bad argument: unknown write op ' .. tostring(kind))
  end
end

-- Replace elements lo..hi of a heterogeneous leaf (see the header).
local dirty = {}  -- key -> true once an op of pass 2 wrote it
local function splice(op)
  local lo, hi, n = op.lo, op.hi, op.hi - op.lo + 1
  local offs, same = op.offs, op.same
  if dirty[op.okey] then  -- an earlier op of this call moved the offsets: read them as they are now
    offs = redis.call('GETRANGE', op.okey, 8 * lo, 8 * (hi + 2) - 1)
    same = sizes_kept(offs, op.sizes)
  end
  local first = tds_u64(offs, 1)
  if same then
    if #op.data > 0 then
      redis.call('SETRANGE', op.dkey, first, op.data)
    end
    if op.rec > 8 then  -- one dim: the same sizes are the same shapes (see the header)
      redis.call('SETRANGE', op.skey, lo * op.rec, op.shapes)
    end
    return
  end
  local old_end = tds_u64(offs, 8 * n + 1)
  local olen = redis.call('STRLEN', op.okey)
  local total_end = tds_u64(redis.call('GETRANGE', op.okey, olen - 8, olen - 1), 1)
  local tail = ''
  if total_end > old_end then
    tail = redis.call('GETRANGE', op.dkey, old_end, total_end - 1)
  end
  if #op.data > 0 then
    redis.call('SETRANGE', op.dkey, first, op.data)
  end
  if #tail > 0 then
    redis.call('SETRANGE', op.dkey, first + #op.data, tail)
  end
  local delta = #op.data - (old_end - first)
  local parts = {}
  local pos = first
  for j = 1, n do
    pos = pos + op.sizes[j]
    parts[j] = tds_p64(pos)
  end
  if olen > 8 * (hi + 2) then
    -- shift every later offset by delta: the O(count - hi) part, inlined because it
    -- dominates a shape-changing write (about 1 us per entry on Redis 7)
    local rest = redis.call('GETRANGE', op.okey, 8 * (hi + 2), olen - 1)
    local byte, char = string.byte, string.char
    local m = #parts
    for p = 1, #rest, 8 do
      local b1, b2, b3, b4, b5, b6, b7, b8 = byte(rest, p, p + 7)
      local v = ((((((b8 * 256 + b7) * 256 + b6) * 256 + b5) * 256 + b4) * 256 + b3) * 256 + b2) * 256 + b1 + delta
      local r1 = v % 256
      v = (v - r1) / 256
      local r2 = v % 256
      v = (v - r2) / 256
      local r3 = v % 256
      v = (v - r3) / 256
      local r4 = v % 256
      v = (v - r4) / 256
      local r5 = v % 256
      v = (v - r5) / 256
      local r6 = v % 256
      v = (v - r6) / 256
      local r7 = v % 256
      v = (v - r7) / 256
      m = m + 1
      parts[m] = char(r1, r2, r3, r4, r5, r6, r7, v)
    end
  end
  redis.call('SETRANGE', op.okey, 8 * (lo + 1), table.concat(parts))
  if op.rec > 0 then
    redis.call('SETRANGE', op.skey, lo * op.rec, op.shapes)
  end
end

-- a ring write of a store with priorities: its tree (and sample counts) checked before any write
if trajectories ~= nil or episodes ~= nil then  -- the episode index (_episodes.lua): checked before any write
  if trajectories == nil or episodes == nil then
    return tds_stale(meta)  -- planned by a client that does not know the ring's trajectory setting: nothing written
  end
  episodes.by = (cjson.decode(trajectories) or {}).by
  tds_ep_check(episodes.by, episodes.ids, ring_n)
end
local tree, times_key = nil, nil
if policy ~= nil and policy.alpha ~= nil then
  if prio == nil then
    return tds_stale(meta)  -- planned by a client that does not know the priorities: nothing written
  end
  tree = tds_tree(prio.tree, tds_int_field(redis.call('HGET', meta, 'count'), 'count', 0, TDS_MAXINT))
  if policy.mt ~= nil then
    times_key = prio.times
    tds_times_check(times_key, tree.count)
  end
  if not pcall(tds_weight, top_priority, policy.alpha, tree.count) then
    tds_bad_field('pm', string.format('%.17g', top_priority), 'a priority whose weight the tree takes')
  end
  -- each written slot weighs its priority ^ alpha: the one given, else the largest so far; the new
  -- weights and their ancestors are computed (every tree block they touch read and checked) here,
  -- before the first write, and flushed in pass 2
  local upd = {}
  prio.top = top_priority
  for j = 1, ring_n do
    local p = prio.values[j] or top_priority
    upd[rows[j]] = prio.weights[j] or tds_weight(p, policy.alpha)
    if p > prio.top then
      prio.top = p
    end
  end
  tds_tree_set(tree, upd)
end

-- pass 2: write
-- At maxmemory Redis refuses a script's first command that may grow memory, but lets every
-- command after the script's first write through (a script cannot stop halfway), so a call
-- whose first write is a DEL could allocate past the limit. A call that writes data therefore
-- starts with a no-op write that Redis checks (HSETNX of an existing field): refused at
-- maxmemory before anything changes. Calls that only delete keep working, and free memory.
-- A call whose first write is its first op's SETRANGE (an element write) needs no such
-- write: that SETRANGE is refused the same way.
-- Bytes this call allocates (keys allocated, set or grown; a staged blob is in memory already): refused before any write when they
-- would take a server that does not evict past its maxmemory, its ARGV (freed when it returns) left out
-- (tds_room). Redis checks maxmemory only when a script starts, so one call could otherwise overshoot it
-- by all it allocates.
for _, op in ipairs(ops) do
  if op.kind == 'S' then
    allocated = allocated + #op.value
  elseif op.kind == 'Z' then
    allocated = allocated + op.n
  end
end
for _, g in pairs(grow) do
  if g.delta > 0 then
    allocated = allocated + g.delta
  end
end
if allocated > 0 then
  tds_room(allocated)
end

local grows, records = #allocate > 0, #allocate > 0
for _, op in ipairs(ops) do
  grows = grows or op.kind ~= 'D'
  records = records or op.kind == 'S' or op.kind == 'Z' or op.kind == 'C' or op.kind == 'O' or op.kind == 'M' or op.kind == 'D'
end
local first = ops[1]
local setrange_first = not records and ARGV[3] == '' and first ~= nil
  and (first.kind == 'P' or ((first.kind == 'R' or first.kind == 'E') and #first.data > 0))
if grows and not setrange_first then
  redis.call('HSETNX', meta, 'version', '0')
end
-- the inventory (see _lib.lua), looked up only by a call that changes which keys hold data:
-- keys allocated here, and keys the ops set or delete whole
local inv = records and tds_inventory(meta) or nil
for _, alloc in ipairs(allocate) do
  if alloc[3] > 0 then  -- a shape table: empty records
    redis.call('SET', alloc[1], pending[alloc[1]] or tds_blank(meta, alloc[2], alloc[3]))
  else
    redis.call('SETRANGE', alloc[1], alloc[2] - 1, '\0')
  end
  tds_record(meta, inv, alloc[1])
end
for _, op in ipairs(ops) do
  if op.kind == 'S' or op.kind == 'Z' or op.kind == 'C' or op.kind == 'O' then
    tds_record(meta, inv, op.key)
  elseif op.kind == 'M' then
    tds_record(meta, inv, op.dst)
  elseif op.kind == 'D' then
    tds_forget(meta, inv, op.key)
  end
end
for _, op in ipairs(ops) do
  if op.kind == 'R' then
    if op.n == 1 then
      if #op.data > 0 then
        redis.call('SETRANGE', op.key, tds_u64(op.ranges, 1), op.data)
      end
    else
      local pos = 1
      for j = 0, op.n - 1 do
        local len = tds_u64(op.ranges, 16 * j + 9)
        if len > 0 then
          redis.call('SETRANGE', op.key, tds_u64(op.ranges, 16 * j + 1), tds_part(op.data, pos, pos + len - 1))
        end
        pos = pos + len
      end
    end
  elseif op.kind == 'P' then
    redis.call('SETRANGE', op.key, op.start, op.part)
  elseif op.kind == 'S' then
    redis.call('SET', op.key, op.value)
  elseif op.kind == 'O' then
    redis.call('DEL', op.key)
    if redis.call('EXISTS', op.src) == 1 then
      redis.call('COPY', op.src, op.key)
    end
  elseif op.kind == 'D' then
    redis.call('DEL', op.key)
  elseif op.kind == 'Z' then
    redis.call('DEL', op.key)
    if op.n > 0 then
      redis.call('SETRANGE', op.key, op.n - 1, '\0')
    else
      redis.call('SET', op.key, '')
    end
  elseif op.kind == 'M' then
    redis.call('RENAME', op.src, op.dst)
    redis.call('PERSIST', op.dst)
  elseif op.kind == 'C' then
    local blob = redis.call('GET', op.src) or ''
    local parts, sub = {}, string.sub
    for r = 0, math.floor(#blob / op.stride) - 1 do
      local s = r * op.stride + op.col
      parts[r + 1] = sub(blob, s + 1, s + op.nb)
    end
    redis.call('SET', op.key, table.concat(parts))
  elseif op.kind == 'F' then
    if op.b > op.a then
      redis.call('SETRANGE', op.dkey, op.a, string.rep(op.pattern, (op.b - op.a) / #op.pattern))
    end
  else
    splice(op)
  end
  dirty[op.key or op.dkey or op.dst] = true
  if op.okey ~= nil then
    dirty[op.okey] = true
  end
end
if ARGV[3] ~= '' then
  tds_set_schema(meta, ARGV[3], ARGV[4])
  version = redis.call('HGET', meta, 'version')
end
if count_in_place then
  redis.call('HINCRBY', meta, 'tr', 1)
end
if ring_n > 0 then
  redis.call('HINCRBY', meta, 'rw', string.format('%.0f', ring_from + ring_n))
  if episodes ~= nil then
    tds_ep_write(meta, episodes.key, episodes.by, ring_rw0, ring_n, ring_count, episodes.ids)
  end
  tds_stat_written(ring_rw0, ring_n, ring_count)
  tds_stat('hw_ms', tds_stats.held)
  if tree ~= nil then
    -- the new weights were set in the tree's blocks before pass 2
    for j = 1, ring_n do
      if times_key ~= nil then
        redis.call('SETRANGE', times_key, 4 * rows[j], '\0\0\0\0')  -- a new item, never sampled
      end
    end
    tds_tree_flush(tree)
    redis.call('HSET', meta, 'pm', string.format('%.17g', prio.top))
  end
  if rollout ~= nil then
    tds_ro.stamp(meta, rollout)
  end
  if channel ~= nil and channel ~= '' then
    redis.call('PUBLISH', channel, 'w')
  end
end
-- SET and RENAME drop a key's expiry: new keys get the header's deadline (tds_deadline_of), so a
-- store with a time to live expires as a whole (looked up only when some key may need it: an
-- element write into existing keys skips it)
local expiring = #allocate > 0 or #fresh > 0 or inv ~= nil
for _, op in ipairs(ops) do
  expiring = expiring or op.kind == 'S' or op.kind == 'M' or op.kind == 'Z' or op.kind == 'C' or op.kind == 'O'
end
local at = expiring and tds_deadline_of(meta) or -1
if at > 0 then
  for _, op in ipairs(ops) do
    if op.kind == 'S' or op.kind == 'M' or op.kind == 'Z' or op.kind == 'C' or op.kind == 'O' then
      redis.call('PEXPIREAT', op.key or op.dst, at)
    end
  end
  for _, alloc in ipairs(allocate) do
    redis.call('PEXPIREAT', alloc[1], at)
  end
  for _, k in ipairs(fresh) do
    redis.call('PEXPIREAT', k, at)  -- a no-op when no op created it
  end
  if inv ~= nil then
    redis.call('PEXPIREAT', inv, at)  -- a no-op when it holds nothing yet
  end
end
if extra ~= nil then
  if request ~= nil then  -- what a resend gets back: the ring write's first write number, or the rows applied
    tds_remember(request, ring_n > 0 and 'W' .. extra or 'G' .. tds_runs(extra))
  end
  return {'OK', version, extra}
end
if request ~= nil then  -- a schema change that carries an id: its resend must not plan it again
  tds_remember(request, 'S')
end
return {'OK', version}
