--[[
  _rollouts.lua: helpers prepended (after the others) to write.lua ('V' op) and read.lua ('G' and
  'H' ops) and to rollouts.lua: LLM-RL rollouts on a ring (tdstore/_ring/rollouts.py).

  Not a script on its own. Everything hangs off one local table, tds_ro, so the scripts it is
  prepended to keep their count of locals. A ring write may stamp its rows with the policy
  version that made them and put them in a group of n rows (GRPO: n completions of one prompt);
  a group's rows stay invisible to samples and pops until the group holds its n rows, written
  by any number of processes and calls, then they appear at once (in the call that completes
  it). The learner publishes its version (header field 'cv', rollouts.lua); samples and pops
  may take only rows at most k versions behind it, and pops may take whole groups or a token
  budget. Items are named by their ring write number w (slot w % count), which never repeats.

  The keys (tdstore/_format/keys.py names them; all under the store's hash tag), as the table K:
    K.z   zset   visible rows: slot -> version (a row of an incomplete group is not in it)
    K.r   zset   complete groups: group id -> the lowest version of its rows
    K.g   hash   group id -> '<size> <lowest version> <w>,<v> <w>,<v> ...' (its rows so far)
    K.s   hash   slot -> '<w> <group id>' for a row written into a group
    K.q   list   the queue of pops, in the order items became visible: one entry per row
                 written outside a group, one per group once whole: '<lowest version> <w>,<v> ...'
                 (at most 'count' entries: older ones were overwritten anyway)
  Header fields: 'ro' ('1' once the store keeps this index: every ring write then stamps its
  rows, and samples and pops take read.lua's 'G' op; setting it bumps 'kv' and 'version', so a client planning
  without it is answered STALE), 'cv' (the published version, 0 before any).
  A row overwritten by a ring write leaves K.z; its group, if any, is broken (its record and
  K.r entry go; its other rows stay visible one by one, and a queue entry naming it is lost).
  Stats: a sample or pop counts the age in policy versions of the rows it hands out (count_age).
  Bounds: a write costs O(rows + group size); a sample O(rows * log slots) (ZRANGE by rank);
  a pop looks at most SCAN queue entries (stale and lost ones are dropped as it goes).
]]
local tds_ro = {
  SCAN = 2048,  -- queue entries one pop looks at, at most (~20 ms of stale entries dropped)
  CHUNK = 64,  -- queue entries read per LRANGE
  BACKFILL = 4096,  -- rows written before the index was on that turning it on indexes, at most (~30 ms)
}

function tds_ro.fmt(n)
  return string.format('%.0f', n)
end

-- A decimal integer argument in 0..2^53.
function tds_ro.int(v, what)
  if type(v) ~= 'string' or not string.match(v, '^%d+$') or tonumber(v) > TDS_MAXINT then
    error('TDSTORE bad argument: ' .. what .. ' ' .. tostring(v))
  end
  return tonumber(v)
end

-- The five keys, from the KEYS indices at ARGV[a .. a + 4].
function tds_ro.keys(a)
  local K, names = {}, {'z', 'r', 'g', 's', 'q'}
  for j = 1, 5 do
    local k = KEYS[tds_num(ARGV[a + j - 1], 'key index')]
    if k == nil then
      error('TDSTORE bad argument: key index out of range')
    end
    K[names[j]] = k
  end
  return K
end

-- The members of a group record or queue entry after its 'skip' leading words: {{w, v}, ...}.
function tds_ro.members(text, skip)
  local out, k = {}, 0
  for word in string.gmatch(text, '%S+') do
    k = k + 1
    if k > skip then
      local w, v = string.match(word, '^(%d+),(%d+)$')
      if w == nil then
        tds_damaged('a rollout record holds ' .. string.sub(text, 1, 60))
      end
      w, v = tonumber(w), tonumber(v)
      if w > TDS_MAXINT or v > TDS_MAXINT then
        tds_damaged('a rollout record holds ' .. string.sub(text, 1, 60))
      end
      out[#out + 1] = {w, v}
    end
  end
  return out
end

function tds_ro.join(members)
  local parts, low = {}, nil
  for j, m in ipairs(members) do
    parts[j] = tds_ro.fmt(m[1]) .. ',' .. tds_ro.fmt(m[2])
    if low == nil or m[2] < low then
      low = m[2]
    end
  end
  return table.concat(parts, ' '), low or 0
end

-- write.lua 'V', kz, kr, kg, ks, kq, version, max_ahead, group, size (at ARGV[a]), after its 'W'
-- op: checked before any write. Returns the stamp to apply once the rows are written, or
-- {wait = reply} when the version runs more than max_ahead ahead of the published one.
function tds_ro.parse_write(meta, a, rw, count, n)
  local K = tds_ro.keys(a + 1)
  local head = redis.call('HMGET', meta, 'cv', 'ro')
  local cv = tds_int_field(head[1], 'cv', 0, TDS_MAXINT, 0)
  local v = ARGV[a + 6] == '' and cv or tds_ro.int(ARGV[a + 6], 'version')
  if ARGV[a + 7] ~= '' and v > cv + tds_ro.int(ARGV[a + 7], 'max_ahead') then
    return {wait = {'WAIT', 'ahead', 'rows of version ' .. tds_ro.fmt(v) .. ' run more than ' .. ARGV[a + 7]
      .. ' versions ahead of the published version ' .. tds_ro.fmt(cv) .. ' (set_version)'}}
  end
  local W = {K = K, v = v, rw = rw, count = count, n = n, gid = ARGV[a + 8], fresh = not head[2], cv = cv}
  if W.fresh then
    tds_ro.backfill_check(rw, count)
  end
  if W.gid ~= '' then
    local size = tds_ro.int(ARGV[a + 9], 'group size')
    if #W.gid > 512 then
      error('TDSTORE bad argument: group id longer than 512 bytes')
    end
    if size < 1 or size > count then
      error('TDSTORE refused: group ' .. W.gid .. ' of ' .. size .. ' rows cannot fit a ring of ' .. count .. ' slots')
    end
    local rec = redis.call('HGET', K.g, W.gid)
    local have = 0
    if rec then
      local gsize = tonumber(string.match(rec, '^(%d+) '))
      if gsize ~= size then
        error('TDSTORE refused: group ' .. W.gid .. ' has ' .. tostring(gsize) .. ' rows, this write says group_size=' .. size)
      end
      have = #tds_ro.members(rec, 2)
      if have >= size then
        error('TDSTORE refused: group ' .. W.gid .. ' is whole already (' .. size .. ' rows); a group id names one live group')
      end
    end
    if have + n > size then
      error('TDSTORE refused: group ' .. W.gid .. ' holds ' .. have .. ' of its ' .. size .. ' rows; ' .. n .. ' more would overflow it')
    end
    W.size, W.rec = size, rec
  end
  return W
end

-- Slot s is being overwritten (its old row was ring write oldw): it leaves the visible rows, and
-- its group, if it had one still live, is broken.
function tds_ro.unlink(K, s)
  redis.call('ZREM', K.z, s)
  local old = redis.call('HGET', K.s, s)
  if old then
    redis.call('HDEL', K.s, s)
    local w, gid = string.match(old, '^(%d+) (.*)$')
    local rec = gid and redis.call('HGET', K.g, gid)
    if rec and string.find(' ' .. rec, ' ' .. w .. ',', 1, true) then
      redis.call('HDEL', K.g, gid)
      redis.call('ZREM', K.r, gid)
    end
  end
end

-- After the rows of W are written (write.lua's pass 2): the index follows them.
function tds_ro.stamp(meta, W)
  local K, count, fmt = W.K, W.count, tds_ro.fmt
  local entries = {}
  if W.fresh then
    tds_ro.turn_on(meta, K, W.cv, W.rw, count, tds_int_field(redis.call('HGET', meta, 'rr'), 'rr', 0, W.rw, 0))
  end
  for j = 1, W.n do
    tds_ro.unlink(K, fmt((W.rw + j - 1) % count))
  end
  if W.gid == '' then
    local vs = fmt(W.v)
    for j = 1, W.n do
      local w = W.rw + j - 1
      redis.call('ZADD', K.z, vs, fmt(w % count))
      entries[j] = vs .. ' ' .. fmt(w) .. ',' .. vs
    end
  else
    -- the record read at parse time may be gone: this call's own rows broke it (a group as large as the ring)
    local rec = redis.call('HGET', K.g, W.gid)
    local members = rec and tds_ro.members(rec, 2) or {}
    for j = 1, W.n do
      local w = W.rw + j - 1
      redis.call('HSET', K.s, fmt(w % count), fmt(w) .. ' ' .. W.gid)
      members[#members + 1] = {w, W.v}
    end
    local text, low = tds_ro.join(members)
    redis.call('HSET', K.g, W.gid, fmt(W.size) .. ' ' .. fmt(low) .. ' ' .. text)
    if #members == W.size then  -- whole: every row appears now, in this call
      for _, m in ipairs(members) do
        redis.call('ZADD', K.z, fmt(m[2]), fmt(m[1] % count))
      end
      redis.call('ZADD', K.r, fmt(low), W.gid)
      entries[1] = fmt(low) .. ' ' .. text
    end
  end
  tds_ro.push(K.q, entries)
  local over = #entries > 0 and redis.call('LLEN', K.q) - count or 0
  if over > 0 then  -- the oldest entries: their rows were overwritten (lost, counted as a pop would)
    local lost = 0
    for _, e in ipairs(redis.call('LRANGE', K.q, 0, over - 1)) do
      lost = lost + #tds_ro.members(e, 1)
    end
    redis.call('LTRIM', K.q, over, -1)
    tds_stat('lost', lost)
  end
end

function tds_ro.backfill_check(rw, count)
  if math.min(rw, count) > tds_ro.BACKFILL then
    error('TDSTORE refused: the ring holds ' .. tds_ro.fmt(math.min(rw, count)) .. ' rows written before rollouts were turned on (at most '
      .. tds_ro.BACKFILL .. ' are indexed then): call set_version before the first extend, or use a new ring')
  end
end

function tds_ro.push(key, items)
  for j = 1, #items, 256 do
    local part = {}
    for m = j, math.min(j + 255, #items) do
      part[#part + 1] = items[m]
    end
    redis.call('RPUSH', key, unpack(part))
  end
end

-- The header's 'ro' set (once), kv and version moved so that clients planning without it get STALE; the rows the
-- ring holds already (rw of them written, the plain pops' cursor at rr) become visible rows of version cv,
-- the ones no plain pop took queued for pops. backfill_check first (before any write).
function tds_ro.turn_on(meta, K, cv, rw, count, rr)
  if redis.call('HSETNX', meta, 'ro', '1') == 0 then
    return
  end
  -- both, as sampling.lua does: a schema change sets kv to its new version, so kv alone moved by one
  -- could meet the value the next key change gives it, and a handle planned between would pass
  redis.call('HINCRBY', meta, 'kv', 1)
  redis.call('HINCRBY', meta, 'version', 1)
  local vs, written, queued = tds_ro.fmt(cv), math.min(rw, count), {}
  for j = 1, written, 256 do
    local part = {}
    for w = rw - written + j - 1, math.min(rw - written + j + 254, rw - 1) do
      part[#part + 1] = vs
      part[#part + 1] = tds_ro.fmt(w % count)
    end
    redis.call('ZADD', K.z, unpack(part))
  end
  for w = math.max(rr, rw - count), rw - 1 do
    queued[#queued + 1] = vs .. ' ' .. tds_ro.fmt(w) .. ',' .. vs
  end
  tds_ro.push(K.q, queued)
end

-- The length of row 'slot' of the leaf an 'H' op named (L: its offset and shape key blocks, record
-- size and item size), per = elements per segment: the element's first dim.
function tds_ro.length(L, slot, per)
  local seg, row = tds_locate(slot, per)
  local okey = tds_segkey(L.ko, seg)
  local offs = redis.call('GETRANGE', okey, 8 * row, 8 * row + 15)
  if #offs ~= 16 then
    tds_damaged(okey .. ' holds no offsets for element ' .. row)
  end
  local bytes = tds_u64(offs, 9) - tds_u64(offs, 1)
  if L.rec == 8 then
    return math.floor(bytes / L.isz)
  end
  local skey = tds_segkey(L.ks, seg)
  local rec = redis.call('GETRANGE', skey, row * L.rec, row * L.rec + 7)
  if #rec ~= 8 then
    return 0  -- never written shape records: an empty element
  end
  return tds_u64(rec, 1)
end

-- read.lua 'G', mode, n, groups, staleness, budget, fixed, draws, channel, kz, kr, kg, ks, kq (at
-- ARGV[a]): picks the rows. Returns a table: reply (a WAIT or LOST reply, sent as it is) or rows,
-- the four pieces (slots, versions, sizes per group or entry, 'skipped lost'), decision (what a
-- request id records) and finish (the pop's changes, run once every op has read).
function tds_ro.pick(meta, a, count, rw, request, per, L)
  local mode, n, by_groups = ARGV[a + 1], tds_ro.int(ARGV[a + 2], 'row count'), ARGV[a + 3] == '1'
  local budget = ARGV[a + 5] ~= '' and tds_ro.int(ARGV[a + 5], 'token budget') or nil
  local fixed = ARGV[a + 6] ~= '' and tds_ro.int(ARGV[a + 6], 'fixed length') or nil
  local draws, channel = ARGV[a + 7], ARGV[a + 8]
  local K = tds_ro.keys(a + 9)
  local cv = tds_int_field(redis.call('HGET', meta, 'cv'), 'cv', 0, TDS_MAXINT, 0)
  local floor = ARGV[a + 4] ~= '' and cv - tds_ro.int(ARGV[a + 4], 'max_staleness') or nil
  -- age: the rows' age in policy versions (cv - v, 0 for a row ahead of cv), counted by count_age
  local got = {rows = {}, slots = {}, versions = {}, sizes = {}, skipped = 0, lost = 0, age = {cv = cv, sum = 0, most = -1}}
  local function take(members)
    local age = got.age
    for _, m in ipairs(members) do
      local s = m[1] % count
      if age then
        local d = math.max(0, cv - m[2])
        age.sum, age.most = age.sum + d, math.max(age.most, d)
      end
      got.rows[#got.rows + 1] = s
      got.slots[#got.slots + 1] = tds_p64(s)
      got.versions[#got.versions + 1] = tds_p64(m[2])
    end
    got.sizes[#got.sizes + 1] = tds_p64(#members)
  end
  if request ~= nil and request.seen then
    -- a resent pop: the items the first attempt took, read again as they are now, nothing moved
    local seen = request.seen
    got.age = nil  -- counted by the first attempt
    local sk, lo, sizes, rest = string.match(seen, '^G(%d+) (%d+) ([%d,]+) ?(.*)$')
    if sk == nil then
      tds_damaged('reply cache record ' .. string.sub(seen, 1, 40))
    end
    local members = tds_ro.members(rest, 0)
    for _, m in ipairs(members) do
      if m[1] < rw - count then
        return {reply = {'LOST', tds_ro.fmt(#members), 'resent'}}
      end
    end
    local k = 0
    for size in string.gmatch(sizes, '%d+') do
      local part = {}
      for j = k + 1, k + tonumber(size) do
        part[#part + 1] = members[j]
      end
      k = k + tonumber(size)
      take(part)
    end
    got.skipped, got.lost = tonumber(sk), tonumber(lo)
    return got
  end
  if mode == 's' then
    if #draws ~= 8 * n then
      error('TDSTORE bad argument: draw table size')
    end
    local zkey = by_groups and K.r or K.z
    local total = redis.call('ZCARD', zkey)
    local m = floor and redis.call('ZCOUNT', zkey, floor, '+inf') or total
    if m == 0 then
      local what = by_groups and 'whole group' or 'visible row'
      return {reply = {'WAIT', total == 0 and 'empty' or 'stale', total == 0 and ('no ' .. what .. ' yet')
        or ('no ' .. what .. ' of version >= ' .. tds_ro.fmt(floor) .. ' (published ' .. tds_ro.fmt(cv) .. ')')}}
    end
    for j = 1, n do
      local r = total - m + tds_u64(draws, 8 * j - 7) % m
      local hit = redis.call('ZRANGE', zkey, r, r, 'WITHSCORES')
      if by_groups then
        local rec = hit[1] and redis.call('HGET', K.g, hit[1])
        if not rec then
          tds_damaged('whole group ' .. tostring(hit[1]) .. ' of ' .. K.r .. ' has no record in ' .. K.g)
        end
        local members = tds_ro.members(rec, 2)
        for _, m in ipairs(members) do
          if m[1] >= rw or m[1] < rw - count then
            tds_damaged(K.g .. ' names ring write ' .. tds_ro.fmt(m[1]) .. ' of a live group, outside ' .. tds_ro.fmt(rw - count) .. '..' .. tds_ro.fmt(rw - 1))
          end
        end
        take(members)
      else
        local slot, v = tonumber(hit[1] or ''), tonumber(hit[2] or '')
        if slot == nil or v == nil or slot ~= math.floor(slot) or slot < 0 or slot >= math.min(rw, count) or v < 0 or v ~= math.floor(v) or v > TDS_MAXINT then
          tds_damaged(K.z .. ' holds ' .. tostring(hit[1]) .. ' -> ' .. tostring(hit[2]) .. ', not a written slot and a version')
        end
        take({{slot, v}})
      end
    end
    return got
  end
  -- a pop: queue entries in order; lost and stale ones are dropped (and counted) on the way
  local taken, nrows, used, i, done = {}, 0, 0, 0, false
  while not done and i < tds_ro.SCAN do
    local chunk = redis.call('LRANGE', K.q, i, i + tds_ro.CHUNK - 1)
    if #chunk == 0 then
      break
    end
    for _, e in ipairs(chunk) do
      local members = tds_ro.members(e, 1)
      local low = tonumber(string.match(e, '^(%d+) ') or '')
      if low == nil or #members == 0 then
        tds_damaged(K.q .. ' holds the entry ' .. string.sub(e, 1, 60))
      end
      local dead = false
      for _, m in ipairs(members) do
        if m[1] >= rw then
          tds_damaged(K.q .. ' names ring write ' .. tds_ro.fmt(m[1]) .. ', not written yet (' .. tds_ro.fmt(rw) .. ' written)')
        end
        dead = dead or m[1] < rw - count
      end
      local len = 0
      if dead then
        got.lost = got.lost + #members
      elseif floor and low < floor then
        got.skipped = got.skipped + #members
      else
        local fits
        if budget ~= nil then
          for _, m in ipairs(members) do
            len = len + (fixed or tds_ro.length(L, m[1] % count, per))
          end
          fits = used + len <= budget and #taken < n
          if not fits and #taken == 0 and used + len > budget then
            error('TDSTORE refused: a token budget of ' .. budget .. ' is smaller than the next ' .. (#members > 1 and 'group' or 'row')
              .. ' (' .. tds_ro.fmt(len) .. ' tokens in ' .. #members .. ' rows)')
          end
        elseif by_groups then
          fits = #taken < n
        else
          fits = nrows + #members <= n
          if not fits and #taken == 0 then
            error('TDSTORE refused: the next group holds ' .. #members .. ' rows, more than the ' .. n .. ' asked: pop(groups=...) or a larger batch')
          end
        end
        if not fits then
          done = true
          break
        end
        taken[#taken + 1] = members
        nrows, used = nrows + #members, used + len
      end
      i = i + 1
      if (by_groups and #taken >= n) or (budget == nil and not by_groups and nrows >= n) then
        done = true
        break
      end
    end
  end
  local dropped = i
  local function drop()
    if dropped > 0 then
      redis.call('LTRIM', K.q, dropped, -1)
    end
    tds_stat('stale', got.skipped)
    tds_stat('lost', got.lost)
  end
  if #taken == 0 then
    drop()  -- stale and lost entries go even when nothing is handed out
    return {reply = {'WAIT', 'empty', 'no ' .. (floor and 'fresh ' or '') .. 'visible item to pop' ..
      (got.skipped + got.lost > 0 and (' (dropped ' .. got.skipped .. ' stale, ' .. got.lost .. ' lost)') or '')}}
  end
  local words, sizes = {}, {}
  for _, members in ipairs(taken) do
    take(members)
    sizes[#sizes + 1] = tds_ro.fmt(#members)
    words[#words + 1] = (tds_ro.join(members))
  end
  got.decision = 'G' .. tds_ro.fmt(got.skipped) .. ' ' .. tds_ro.fmt(got.lost) .. ' ' .. table.concat(sizes, ',') .. ' ' .. table.concat(words, ' ')
  got.finish = function()
    drop()
    tds_stat('pop', nrows)
    tds_ro.count_age(got)
    tds_stat('hp_ms', tds_stats.held)
    if channel ~= '' then
      redis.call('PUBLISH', channel, 'p')
    end
  end
  return got
end

-- Count the age in policy versions of the rows a 'G' op hands out (got from pick; nothing for a
-- resent call): their number ('agev_rows'), sum ('agev_sum') and the largest ('agev_max'), in the
-- stats hash (lua/README.md "Stats"). O(1) here: pick summed them as it took the rows.
function tds_ro.count_age(got)
  if got.age ~= nil and got.age.most >= 0 then
    tds_stat('agev_rows', #got.rows)
    tds_stat('agev_sum', got.age.sum)
    tds_stat_max('agev_max', got.age.most)
  end
end
