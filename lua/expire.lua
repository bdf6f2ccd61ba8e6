--[[
  expire.lua: give every key of a store the same time to live, or remove it; or one batch.

  All keys get the same deadline in one atomic step (time stands still inside a
  script), so a store never expires in part: a reader sees the whole store or
  none of it. Keys the store creates later (new leaves) take the header's TTL in
  write.lua. The version check makes a client whose cache misses a newer leaf
  refresh first, so no key is left without the deadline.

  A store of more keys than one call may touch (tdstore/_engine/batches.py) goes in batches
  of keys, all with the one deadline the first batch read (and returned): the first
  batch gives the header the later of its old and new deadline and records the earlier
  one in its field 'xd' (tds_ttl_begin in _lib.lua), the last one gives the header the
  new deadline and drops 'xd'. So the header outlives every key whichever batch a
  client dying half-way reached, and once a key may have expired ('xd' passed) every
  script answers GONE for the store: never damaged, never zeros, never keys left
  without their header. A schema change in between makes a batch STALE: the client
  starts over.

  KEYS[1]     store header hash
  KEYS[2..]   every data / offset / shape key of the store (a batch: the keys of this batch,
              and in neither case the header: the phase handles it)
  ARGV[1]     '<epoch>:V<version>': the schema version the client listed the keys from
  ARGV[2]     time to live in milliseconds; '0' removes it (PERSIST)
  ARGV[3]     optional: the deadline in Unix milliseconds that ARGV[2] stands for (a spread
              store: every segment, on whichever node, gets the same one; a later batch:
              the one the first batch returned)
  ARGV[4]     optional: the phase of a call cut in batches: 'first', 'next' or 'last'

  Reply       {'OK', deadline (Unix ms, '' for none)}; {'STALE', header...}; {'GONE'}.
  Errors      'TDSTORE bad argument' when ARGV[2] or ARGV[3] is not a number.
]]
local meta = KEYS[1]
local bad = tds_check(meta, ARGV[1], '')
if bad then
  return bad
end
local deadline = tds_deadline(tds_num(ARGV[2], 'ttl'), ARGV[3])
local phase = ARGV[4] or ''
if phase == '' then
  tds_expire_at(1, #KEYS, deadline)
else
  if phase == 'first' then
    tds_ttl_begin(meta, deadline)
  end
  tds_expire_at(2, #KEYS, deadline)
  if phase == 'last' then
    tds_ttl_end(meta, deadline)
  end
end
return {'OK', deadline and string.format('%.0f', deadline) or ''}
