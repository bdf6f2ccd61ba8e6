--[[
  sampled.lua: count a full ring's uniform sample read as a transaction of GETRANGEs (lua/README.md
  "Stats"): the last command of that transaction, after a plain BITFIELD that set the rows' bits in
  the store's sampled-rows bitmap (cheaper there than from Lua).

  A transaction cannot ask whether the store has a deadline, so this script is what gives the stats
  hash and the bitmap the store's deadline when the transaction created them (the first counted call
  of a store may be such a sample), and deletes a bitmap the BITFIELD made for a store that is gone.

  KEYS[1]     store header hash
  KEYS[2]     the store's stats hash (StoreKeys.stats)
  KEYS[3]     the store's sampled-rows bitmap (StoreKeys.sampled_rows)
  ARGV[1]     rows sampled

  Reply       {'OK'}; {'GONE'} when the store does not exist (nothing counted).
  Errors      'TDSTORE bad argument' when ARGV[1] is not a number.
]]
local meta = KEYS[1]
local n = tds_num(ARGV[1], 'row count')
if redis.call('EXISTS', meta) == 0 or tds_lapsed(meta) then
  redis.call('DEL', KEYS[3])  -- made by this transaction's BITFIELD for no store (its keys are being deleted)
  return {'GONE'}
end
tds_stats.key = KEYS[2]
tds_stat('smpx', n)
local at = nil
for i = 2, 3 do
  if redis.call('PTTL', KEYS[i]) == -1 then  -- exists without a deadline
    at = at or tds_deadline_of(meta)
    if at > 0 then
      redis.pcall('PEXPIREAT', KEYS[i], at)
    end
  end
end
return {'OK'}
