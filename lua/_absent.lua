--[[
  _absent.lua: the rows a checkpoint taken while writers ran could not keep, skipped by the
  samples, pops and priority updates of the ring restored from it. Prepended by
  tdstore/_engine/scripts.py to read.lua, priority.lua and tree_build.lua (which refuses to
  turn priorities on while rows are absent), after _lib.lua and _tree.lua. Not a
  script on its own.

  An export (tdstore/_checkpoint/export_import.py) holds the ring as of one fence (fence.lua): the
  rows of the writes it reads there, [rw - count, rw). Rows that writers overwrote while the export
  read the data are the fence's oldest ones, ring writes [rw - count, ho); the checkpoint keeps
  them absent and restore.lua sets the header field 'ho' ("held from"): the oldest ring write
  whose row the ring holds. Their slots stay written slots of the ring (the cursor, write count
  and generations are the fence's), but a sample draws only among the rows held, writes
  [ho, rw), a queue's read cursor starts at ho (restore.lua), and their priorities are 0.
  Writers overwrite the absent rows first (they are the oldest): once rw - count >= ho, every
  slot holds a row again and 'ho' changes nothing (read.lua then draws as it always did).
]]

-- The oldest ring write whose row the ring holds while a restore left older rows absent
-- (header field 'ho', see above), at ring write count 'rw' of a ring of 'count' slots; nil when
-- every written slot holds its row.
local function tds_held_from(meta, rw, count)
  local ho = redis.call('HGET', meta, 'ho')
  if not ho then
    return nil
  end
  ho = tds_int_field(ho, 'ho', 0, TDS_MAXINT)
  if ho <= rw - count then
    return nil
  end
  return math.min(ho, rw)
end

-- The slot a uniform draw 'd' names among 'held' rows: d % held when every written slot holds its
-- row ('from' nil), else the row of ring write from + d % held.
local function tds_held_slot(d, held, from, count)
  if from == nil then
    return d % held
  end
  return (from + d % held) % count
end

-- Whether slot 's' holds a row at ring write count 'rw' ('from': tds_held_from): false for a slot
-- whose row a restore left absent (update_priority leaves it alone: it is never drawn).
local function tds_holds_row(s, rw, count, from)
  if from == nil then
    return true
  end
  return rw - 1 - (rw - 1 - s) % count >= from
end
