--[[
  ack.lua: acknowledge the items of a leased pop (read.lua's 'L' op), so that they are
  never handed out again.

  Items still held under the receipt are settled; so are items of a lease that expired
  while no other reader has taken them yet. Items another reader holds now, or settled
  by another reader, are not: the reply names them, so the caller knows its work on them
  may be done twice. Acknowledging twice is harmless: the receipt's record then holds
  the first answer, and the same reply comes back (see _lease.lua for the lease keys and
  how long settled receipts are remembered).

  KEYS[1]     store header hash
  KEYS[2..6]  the lease keys, as _lease.lua's K: table (l), deadlines (d), redelivery
              queue (q), outstanding items (o), settled receipts (k)
  KEYS[7]     optional: the store's stats hash, where the items settled are counted ('ack',
              see tds_stat in _lib.lua)
  ARGV[1]     '<epoch>:*' (see tds_check in _lib.lua: the store must be the one leased from)
  ARGV[2]     the receipt (made by the client of the leased pop)
  ARGV[3]     the store's Pub/Sub channel: writers of a full queue may go on

  Reply       {'OK', settled, not_held} where settled counts the items settled by this
              receipt and not_held packs, as little-endian int64, the write numbers of
              its items that it no longer held; {'GONE'} when the store does not exist.
  Errors      'TDSTORE bad argument' for a malformed receipt; 'TDSTORE refused' when the
              store holds no lease under the receipt (never made, a plain pop's, or
              settled longer ago than the 4096 receipts the store remembers);
              'TDSTORE damaged' for a lease table that cannot be read.
]]
local meta = KEYS[1]
local bad = tds_check(meta, ARGV[1], '')
if bad then
  return bad
end
local id, channel = ARGV[2], ARGV[3]
tds_lease.check_receipt(id)
local K = tds_lease.keys({2, 3, 4, 5, 6}, 1)
local state, nums = tds_lease.record(K, id)
if state == 'A' then
  -- acknowledged before (a resend, or a second ack): the first answer again
  local settled = table.remove(nums, 1) or 0
  local packed = {}
  for j = 1, #nums do
    packed[j] = tds_p64(nums[j])
  end
  return {'OK', tds_lease.fmt(settled), table.concat(packed)}
end
if state ~= 'L' and state ~= 'X' then
  error('TDSTORE refused: no lease under receipt ' .. id .. (state == 'S' and ' (a plain pop, settled when it ran)' or ' (never handed out, or settled long ago)'))
end
local held, missed, packed = {}, {}, {}
local ds, owners = tds_lease.items(K, nums)
for j, w in ipairs(nums) do
  -- a live lease holds its items; an expired one those no other reader has taken since
  if ds[j] ~= nil and ((state == 'L' and owners[j] == id) or (state == 'X' and owners[j] == '')) then
    held[#held + 1] = w
  else
    missed[#missed + 1] = w
    packed[#packed + 1] = tds_p64(w)
  end
end
tds_lease.drop(K, held)
local settled = #held
tds_stats.key = KEYS[7]
tds_stat('ack', settled)
redis.call('ZREM', K.d, id)
table.insert(missed, 1, settled)
tds_lease.set_record(K, id, 'A', missed)
tds_lease.tombstone(K, id, tds_lease.now_ms())
tds_lease.settle(meta, K, channel)
return {'OK', tds_lease.fmt(settled), table.concat(packed)}
