--[[
  priority.lua: give slots of a ring with priorities new priorities (update_priority), each
  only where the slot still holds the generation the caller read, in one atomic step.

  A slot's weight in the tree becomes priority ^ alpha (0 for priority 0). A slot that was
  never written, was retired after max_times_sampled samples, holds no row (left absent by a
  checkpoint restore, see _absent.lua), or (with a generation given) was overwritten since,
  keeps its weight: it is reported as not applied.

  KEYS[1]     store header hash
  KEYS[2]     the priority tree (see _tree.lua)
  KEYS[3]     the times-sampled counts (see sampling.lua)
  KEYS[4]     the store's reply cache (see tds_request in _lib.lua), with ARGV[7]
  ARGV[1]     '<epoch>:*' (see tds_check in _lib.lua)
  ARGV[2]     n, the number of slots
  ARGV[3]     n (slot, generation) pairs packed as little-endian int64
  ARGV[4]     '1' to check the generations, '0' to set every slot that holds data
  ARGV[5]     the n priorities as decimal text, space-separated (finite, >= 0)
  ARGV[6]     the store's Pub/Sub channel, published on once the priorities are set
  ARGV[7]     optional: the update's request id. An id already recorded (checked before the
              version) answers its first reply and sets nothing; else the flags are recorded.

  Reply       {'OK', applied} where 'applied' has one '1' or '0' per slot;
              {'STALE', header...}; {'GONE'}.
  Errors      'TDSTORE refused' when the store has no priorities; 'TDSTORE bad argument'
              for a malformed call, or a priority too large for the tree (naming the largest allowed);
              'TDSTORE damaged' when the tree was lost, or a header field or tree value is out
              of range (_lib.lua tds_int_field, _tree.lua): nothing written.
]]
local meta = KEYS[1]
-- a resent update (its request id recorded, see tds_request): the first reply, nothing set again
local request = ARGV[7] and ARGV[7] ~= '' and tds_request(4, ARGV[7]) or nil
if request ~= nil and request.seen then
  if redis.call('EXISTS', meta) == 0 then
    return {'GONE'}
  end
  return {'OK', tds_unruns(string.sub(request.seen, 2))}
end
local bad = tds_check(meta, ARGV[1], '')
if bad then
  return bad
end
local h = redis.call('HMGET', meta, 'count', 'rw', 'sc', 'pm', 'schema')
if not h[3] then
  error('TDSTORE refused: the store has no priorities (enable_priorities first)')
end
local sc = tds_policy(h[3])
if sc.alpha == nil then
  error('TDSTORE refused: the store has no priorities (enable_priorities first)')
end
local count, rw = tds_ring_fields(h[1], h[2])
rw = tds_ring_rw(meta, count, rw)
local written = math.min(rw, count)
local from = tds_held_from(meta, rw, count)  -- rows a restore left absent keep their weight 0 (_absent.lua)
local n = tds_num(ARGV[2], 'slot count')
local pairs_ = ARGV[3]
if #pairs_ ~= 16 * n then
  error('TDSTORE bad argument: slot table size')
end
local check = ARGV[4] == '1'
local prios = {}
for v in string.gmatch(ARGV[5], '%S+') do
  local p = tonumber(v)
  if p == nil or p < 0 or p ~= p or p >= 1e300 then
    error('TDSTORE bad argument: priority ' .. v)
  end
  prios[#prios + 1] = p
end
if #prios ~= n then
  error('TDSTORE bad argument: ' .. #prios .. ' priorities for ' .. n .. ' slots')
end
local t = tds_tree(KEYS[2], count)
local times = nil
if sc.mt ~= nil then
  times = KEYS[3]
  tds_times_check(times, count)
end
local flags, upd = {}, {}
local top = tds_float_field(h[4], 'pm', 0, 1e300, 1)
for j = 1, n do
  local s, want = tds_u64(pairs_, 16 * j - 15), tds_u64(pairs_, 16 * j - 7)
  if s >= count then
    error('TDSTORE bad argument: slot ' .. s .. ' out of range of ' .. count)
  end
  -- a slot holds data when the ring wrote it (a store filled by index or uploaded is a full ring:
  -- tds_ring_rw), or when the tree gave it a weight
  local ok = (s < written or tds_tree_leaf(t, s) > 0) and tds_holds_row(s, rw, count, from)
  if ok and check then
    local gen = 0
    if s < rw then
      gen = math.floor((rw - 1 - s) / count) + 1
    end
    ok = gen == want
  end
  if ok and times ~= nil then
    ok = tds_times(times, s) < sc.mt
  end
  flags[j] = ok and '1' or '0'
  if ok then
    local p = prios[j]
    upd[s] = tds_weight(p, sc.alpha, count)
    if p > top then
      top = p
    end
  end
end
tds_tree_set(t, upd)
tds_tree_flush(t)
redis.call('HSET', meta, 'pm', string.format('%.17g', top))
if ARGV[6] ~= nil and ARGV[6] ~= '' then
  redis.call('PUBLISH', ARGV[6], 'u')  -- samplers waiting for a positive weight may go on
end
tds_remember(request, 'A' .. tds_runs(table.concat(flags)))
return {'OK', table.concat(flags)}
