--[[
  tree_build.lua: turn a ring's priorities on in steps of bounded work, one step per call, so
  that no call blocks the server for long (a tree of 10^7 slots is 90 MB; built in one script
  it blocked every other client for 6 s). The client (tdstore/_ring/policy_calls.py) calls it until it
  answers 'OK ON'; any client asking for the same priorities may make the next step (a builder
  that died is resumed by the next enable_priorities), and a resent step only makes progress.

  The tree is built under its own key (KEYS[4]) while the policy is still off: meanwhile ring
  writes and samples go on as without priorities, where every written slot weighs 1. So the
  tree being built is exactly "slots 0..W-1 weigh 1" for W written slots (tds_ring_rw), and
  every node's value follows from W alone: a node spanning S leaves holds the sum
  clamp(W - first leaf, 0, S) and the min 1 (0 when the sum is 0): the bytes tds_tree_set
  computes from the children (sums of integers, exact in float64). Steps:
    'tree'   allocate the tree and, with max_times_sampled, the sample counts (4 zero bytes per
             slot). A zero-filling SETRANGE costs ~0.4 ms per MB (page faults), so above ARGV[8]
             bytes the script asks the client ({'OK', 'STAGE', ...}) to send the zeros as plain
             SETs to staging keys (KEYS[7], KEYS[8]: the server reads a large argument in pieces,
             between other clients' commands), which this step then RENAMEs into place: O(1).
             Staged keys that come too late (another builder allocated first) are deleted.
    'times'  the sample counts, when the tree was zero-filled by the script (a step of its own)
    'fill'   write a pass: for W written slots, the nodes of every level that lie over leaves
             lo..hi-1 (first pass: 0..W-1; the rest is already zero), at most ARGV[6] bytes
             per call. When a pass ends and slots were written meanwhile (W moved to W'), a
             new pass rewrites the nodes over the leaves between W and W'. When a pass ends
             and W has not moved, the same call switches the policy on: the tree and counts
             are renamed into place (KEYS[2], KEYS[3]), 'sc' is set, 'pm' = 1, the versions
             move and the channel is told, all at once, so no write escapes the tree.
  The state (KEYS[6], a string) is 'epoch count alpha mt step lo hi w k j': the store it is
  for, the requested exponent and max_times_sampled ('-' for none), the step, the pass (leaves
  lo..hi, for w written slots) and its cursor (level k, node j). The build keys live ARGV[7] ms
  (or the store's time to live, when shorter) after the last step: a build nobody resumes
  leaves nothing behind. A state for another store epoch or ring size, or whose keys are
  short (evicted), is thrown away and the build starts again.

  KEYS[1]     store header hash
  KEYS[2]     the priority tree (see _tree.lua)
  KEYS[3]     the times-sampled counts (4 little-endian bytes per slot)
  KEYS[4]     the tree being built
  KEYS[5]     the counts being built
  KEYS[6]     the build's state
  KEYS[7]     the tree's zeros, staged by the client (may be absent)
  KEYS[8]     the counts' zeros, staged by the client (may be absent)
  ARGV[1]     '<epoch>:V<version>' the policy was built from (see tds_check in _lib.lua)
  ARGV[2]     the policy to set at the end (JSON, tdstore/_format/sampling_policy.py), with the priorities on
  ARGV[3]     alpha, as the client formats it (compared with the state's)
  ARGV[4]     max_times_sampled, '-' for none
  ARGV[5]     the store's Pub/Sub channel (told when the policy switches on)
  ARGV[6]     work of one call, at most: bytes of tree written (>= 256; zero-filled bytes count 1/8)
  ARGV[7]     lease of the build keys, ms
  ARGV[8]     allocations above this many bytes are staged by the client ('' : never)

  Reply       {'OK', 'ON', header field, value, ...}: the policy is on (or already was: the
              client compares its parameters); {'OK', 'MORE', step, work done, tree bytes} after
              a step (a small ring is done in one call); {'OK', 'STAGE', tree bytes, count bytes}:
              stage the zeros (count bytes 0: no counts) and call again;
              {'STALE', header...}; {'GONE'}.
  Errors      'TDSTORE bad argument' for a malformed call; 'TDSTORE refused' when another
              client is building priorities with other parameters; 'TDSTORE damaged' for a
              header field out of range (count, rw, kv, sc: see tds_int_field in _lib.lua).
]]
local meta = KEYS[1]
local bad = tds_check(meta, ARGV[1], '')
if bad then
  return bad
end
local h = redis.call('HMGET', meta, 'count', 'rw', 'schema', 'sc', 'epoch', 'kv')
tds_int_field(h[6], 'kv', 0, TDS_MAXINT)  -- bumped by the last step (version: tds_check compared it with the client's)
local count, rw = tds_ring_fields(h[1], h[2])
rw = tds_ring_rw(meta, count, rw)
local held_from = tds_held_from(meta, rw, count)  -- a restored ring with rows absent (_absent.lua): no weight for them
if held_from ~= nil then
  error('TDSTORE refused: priorities cannot be turned on while ' .. string.format('%.0f', held_from - math.max(0, rw - count))
    .. ' rows a checkpoint restore left absent are in the ring; they go once ' .. string.format('%.0f', held_from + count - rw)
    .. ' more rows are written')
end
local function header_reply()
  local out = redis.call('HGETALL', meta)
  table.insert(out, 1, 'ON')
  table.insert(out, 1, 'OK')
  return out
end
local policy = tds_policy(h[4])
if policy and policy.alpha ~= nil then
  return header_reply()  -- on already (another builder finished, or this call's first reply was lost)
end
local budget = math.max(256, tds_num(ARGV[6], 'chunk bytes'))
local lease = tds_num(ARGV[7], 'lease')
local alpha, mt = ARGV[3], ARGV[4]
local levels, size = tds_tree_layout(count)
local st = nil
local raw = redis.call('GET', KEYS[6])
if raw then
  local f = {}
  for word in string.gmatch(raw, '%S+') do
    f[#f + 1] = word
  end
  st = {epoch = f[1], count = tonumber(f[2]), alpha = f[3], mt = f[4], step = f[5], lo = tonumber(f[6]), hi = tonumber(f[7]),
        w = tonumber(f[8]), k = tonumber(f[9]), j = tonumber(f[10])}
  local steps = {tree = true, times = true, fill = true}
  if #f ~= 10 or st.epoch ~= h[5] or st.count ~= count or not steps[st.step] or not (st.lo and st.hi and st.w and st.k and st.j)
     or st.lo < 0 or st.hi < st.lo or st.hi > count or st.w < 0 or st.w > count or st.k < 1 or st.k > #levels + 1 or st.j < 0 then
    st = nil  -- another store's (deleted and created again) or a damaged state: start again
  elseif st.alpha ~= alpha or st.mt ~= mt then
    error('TDSTORE refused: another client is turning priorities on with alpha=' .. st.alpha .. ', max_times_sampled=' ..
          (st.mt == '-' and 'None' or st.mt) .. ' (it finishes, or its build expires ' .. lease .. ' ms after its last step)')
  elseif st.step ~= 'tree' and redis.call('STRLEN', KEYS[4]) ~= size then
    st = nil  -- the tree being built was lost (evicted)
  elseif st.step == 'fill' and mt ~= '-' and redis.call('STRLEN', KEYS[5]) ~= 4 * count then
    st = nil
  end
end
if st == nil then
  redis.call('DEL', KEYS[4], KEYS[5])
  st = {epoch = h[5], count = count, alpha = alpha, mt = mt, step = 'tree', lo = 0, hi = 0, w = 0, k = 1, j = 0}
end

local function save(reply)
  redis.call('SET', KEYS[6], table.concat({st.epoch, string.format('%.0f', count), st.alpha, st.mt, st.step,
    string.format('%.0f', st.lo), string.format('%.0f', st.hi), string.format('%.0f', st.w), st.k, string.format('%.0f', st.j)}, ' '))
  local ttl = redis.call('PTTL', meta)
  local keep = (ttl > 0 and ttl < lease) and ttl or lease
  for i = 4, 6 do
    if redis.call('EXISTS', KEYS[i]) == 1 then
      redis.call('PEXPIRE', KEYS[i], keep)
    end
  end
  return reply
end

local function written_now()
  return math.min(rw, count)
end

-- work done by this call, in bytes of tree written (a zero-filled byte counts 1/8: that much cheaper)
local done = 0
local tsize = mt ~= '-' and 4 * count or 0
if st.step == 'tree' then
  local stage_above = tonumber(ARGV[8] or '')
  if redis.call('STRLEN', KEYS[7]) == size and (tsize == 0 or redis.call('STRLEN', KEYS[8]) == tsize) then
    redis.call('RENAME', KEYS[7], KEYS[4])
    if tsize > 0 then
      redis.call('RENAME', KEYS[8], KEYS[5])
    end
    st.step = 'fill'
  elseif stage_above ~= nil and size + tsize > stage_above then
    return save({'OK', 'STAGE', size, tsize})
  else
    redis.call('SETRANGE', KEYS[4], size - 1, '\0')
    done = done + size / 8
    st.step = tsize > 0 and 'times' or 'fill'
  end
  st.w = written_now()
  st.lo, st.hi, st.k, st.j = 0, st.w, 1, 0
elseif redis.call('EXISTS', KEYS[7]) == 1 or redis.call('EXISTS', KEYS[8]) == 1 then
  redis.call('DEL', KEYS[7], KEYS[8])  -- staged for a step another builder made first
end
if st.step == 'times' then
  if done >= budget then
    return save({'OK', 'MORE', 'tree', size, size})
  end
  redis.call('SETRANGE', KEYS[5], 4 * count - 1, '\0')
  done = done + count / 2
  st.step = 'fill'
end

-- 'fill': nodes j..j+m-1 of level k as the tree of w written slots holds them
local one = tds_f64_pack(1)
local function image(k, j, m, w)
  local level = levels[k]
  local span = TDS_FAN ^ (k - 1)
  local full = math.floor(w / span)
  local part = w - full * span
  local a = math.max(0, math.min(full - j, m))
  local pieces = {}
  if a > 0 then
    pieces[#pieces + 1] = string.rep(level.w == 8 and one or (tds_f64_pack(span) .. one), a)
  end
  local z = m - a
  if part > 0 and full >= j and full < j + m then
    pieces[#pieces + 1] = tds_f64_pack(part) .. one  -- level.w == 16: a leaf's span is 1, so no leaf is partial
    z = z - 1
  end
  if z > 0 then
    pieces[#pieces + 1] = string.rep('\0', z * level.w)
  end
  return table.concat(pieces)
end

while true do
  if st.k > #levels then
    local now = written_now()
    if now == st.w then
      break
    end
    -- slots were written during the build: rewrite the nodes over the leaves between the two counts
    st.lo, st.hi, st.w, st.k, st.j = math.min(st.w, now), math.max(st.w, now), now, 1, math.min(st.w, now)
  end
  if done >= budget then
    return save({'OK', 'MORE', st.step, math.floor(done), size})
  end
  local level = levels[st.k]
  local span = TDS_FAN ^ (st.k - 1)
  local last = math.min(level.n, math.ceil(st.hi / span))  -- exclusive
  if st.j >= last then
    st.k = st.k + 1
    st.j = math.floor(st.lo / (span * TDS_FAN))
  else
    local m = math.min(last - st.j, math.max(1, math.floor((budget - done) / level.w)))
    redis.call('SETRANGE', KEYS[4], level.at + st.j * level.w, image(st.k, st.j, m, st.w))
    done = done + m * level.w
    st.j = st.j + m
  end
end

-- the pass is done and no slot was written since: switch the policy on, all at once
cjson.decode(ARGV[2])  -- a malformed policy is refused before anything moves
redis.call('RENAME', KEYS[4], KEYS[2])
if mt ~= '-' then
  redis.call('RENAME', KEYS[5], KEYS[3])
end
redis.call('DEL', KEYS[6])
redis.call('HSET', meta, 'pm', '1', 'sc', ARGV[2])
redis.call('HINCRBY', meta, 'kv', 1)
redis.call('HINCRBY', meta, 'version', 1)
if ARGV[5] ~= '' then
  redis.call('PUBLISH', ARGV[5], 'c')
end
-- the policy's keys expire with the store (RENAME kept the build's lease)
tds_expire_keys(2, mt ~= '-' and 3 or 2, math.max(redis.call('PTTL', meta), 0))
return header_reply()
