--[[
  _lib.lua: helpers prepended by tdstore/_engine/scripts.py to every other script.

  Not a script on its own. Every function is local, so each registered script
  stays self-contained (EVALSHA needs the whole text) and runs on Lua 5.1 and 5.4
  without bit operators, string.pack, struct or cmsgpack.
]]
local unpack = unpack or table.unpack

-- Decode the little-endian unsigned 64-bit integer at 1-based position p of s.
-- Offsets stay below 2^53, so a Lua double holds them exactly.
local function tds_u64(s, p)
  local b1, b2, b3, b4, b5, b6, b7, b8 = string.byte(s, p, p + 7)
  return ((((((b8 * 256 + b7) * 256 + b6) * 256 + b5) * 256 + b4) * 256 + b3) * 256 + b2) * 256 + b1
end

-- Encode a non-negative integer below 2^53 as 8 little-endian bytes.
local function tds_p64(n)
  local b = {}
  for k = 1, 8 do
    local r = n % 256
    b[k] = r
    n = (n - r) / 256
  end
  return string.char(b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8])
end

-- The reply that tells a client its cached header is stale: 'STALE' then the header hash.
local function tds_stale(meta)
  local r = redis.call('HGETALL', meta)
  table.insert(r, 1, 'STALE')
  return r
end

-- The server's clock in Unix milliseconds (TIME).
local function tds_now_ms()
  local now = redis.call('TIME')
  return tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
end

-- The absolute deadline (Unix ms) of the store whose header is 'meta', -1 for none (-2: no header):
-- new keys get it, so a store with a time to live expires as a whole (SET drops a key's expiry).
-- PEXPIRETIME where the server has it (Redis 7); on Redis 6, whose clock moves inside a script,
-- a PTTL read within one millisecond of TIME (read again until it is) gives it to the millisecond.
local function tds_deadline_of(meta)
  local at = redis.pcall('PEXPIRETIME', meta)
  if type(at) == 'number' then
    return at
  end
  local t0, t1, ttl
  repeat
    t0 = tds_now_ms()
    ttl = redis.call('PTTL', meta)
    t1 = tds_now_ms()
  until t0 == t1
  return ttl > 0 and t0 + ttl or -1
end

-- Whether the header 'meta' stands for a store that a whole-store call cut in batches left
-- half-done (lua/README.md, "Whole-store calls in batches"): a tombstone (state 'deleting':
-- clear.lua deletes the keys batch by batch, the header last), or a header whose field 'xd'
-- (the earliest deadline a key of the store may carry while expire.lua or commit.lua give its
-- keys their deadline batch by batch) has passed. Every script answers GONE for such a store,
-- and create.lua, clear.lua and 'tdstore rm' delete what is left of it.
local function tds_lapsed(meta)
  local h = redis.call('HMGET', meta, 'state', 'xd')
  if h[1] == 'deleting' then
    return true
  end
  return h[2] ~= false and h[2] ~= nil and tonumber(h[2]) ~= nil and tds_now_ms() >= tonumber(h[2])
end

-- Check that the store exists and that the caller's cached header still describes
-- what it is about to touch. 'spec' is '<epoch>:<check>', optionally followed by
-- '@<token>': the header's schema lock (field 'lk', see lock.lua) must then be held
-- with that token (the commit of a schema change of a spread store). The epoch is a random token
-- written when the store was created, so a handle on a store that was deleted and
-- created again under the same id is refused. <check> is 'V<n>' (the whole schema must
-- be at version n: used by schema changes), 'K<n>' (the key set must be at version n:
-- used by reads that select keys by prefix) or '*' (no global check). 'leaves' lists
-- the leaves the call touches as 'number:version' words; each must still carry that
-- leaf version. Returns nil and the current version when the call may go on (one HMGET
-- for the store guards and every leaf version named), else the reply to send back:
-- 'GONE' for a deleted store, 'STALE' + header for an outdated cache.
local function tds_check(meta, spec, leaves)
  local fields, want = {'version', 'epoch', 'kv'}, {}
  for n, v in string.gmatch(leaves, '(%d+):(%d+)') do
    fields[#fields + 1] = 'lv:' .. n
    want[#want + 1] = v
  end
  fields[#fields + 1] = 'xd'  -- last: a whole-store call's deadline in progress (tds_lapsed)
  local xd_at = #fields
  local head = redis.call('HMGET', meta, unpack(fields, 1, math.min(#fields, 512)))
  for i = 513, #fields, 512 do  -- many leaves: more HMGETs, within Lua's stack for unpack
    local part = redis.call('HMGET', meta, unpack(fields, i, math.min(i + 511, #fields)))
    for j = 1, #part do
      head[i + j - 1] = part[j]
    end
  end
  local cur = head[1]
  if not cur then
    -- a header without its version: a tombstone (a delete in batches, tds_lapsed) is gone; any other
    -- was edited by hand (tds_damaged is defined below)
    if head[2] and not tds_lapsed(meta) then
      error('TDSTORE damaged: header field version is missing')
    end
    return {'GONE'}
  end
  if head[xd_at] and tds_lapsed(meta) then
    return {'GONE'}
  end
  local epoch, check = string.match(spec, '^(%x+):(.+)$')
  if epoch == nil then
    error('TDSTORE bad argument: version check ' .. spec)
  end
  if head[2] ~= epoch then
    return tds_stale(meta)
  end
  local at = string.find(check, '@', 1, true)
  if at then
    if redis.call('HGET', meta, 'lk') ~= string.sub(check, at + 1) then
      return tds_stale(meta)
    end
    check = string.sub(check, 1, at - 1)
  end
  local kind = string.sub(check, 1, 1)
  if kind == 'V' then
    if cur ~= string.sub(check, 2) then
      return tds_stale(meta)
    end
  elseif kind == 'K' then
    if head[3] ~= string.sub(check, 2) then
      return tds_stale(meta)
    end
  elseif check ~= '*' then
    error('TDSTORE bad argument: version check ' .. spec)
  end
  for i = 1, #want do
    if head[3 + i] ~= want[i] then
      return tds_stale(meta)
    end
  end
  return nil, cur
end

-- Integrity. Every data and table key of a store must hold what the header implies (see
-- tdstore/_format/integrity.py): a key lost to eviction or a DEL is reported, never recreated as
-- zeros. A store whose header has the field 'na' keeps an inventory, the hash KEYS[2] of
-- every data and table key that has been allocated ('na' counts its entries), so a key that
-- is absent because it was never allocated (a ring or from_schema store allocates a
-- segment when it is first written) can be told from one that was lost. Other stores (a
-- spread store, stores of older releases) allocate every key up front: absent means lost.

-- Raise the one error a damaged store gives (the client names the store and what to do).
local function tds_damaged(what)
  error('TDSTORE damaged: ' .. what)
end

-- Hostile values. Another client may write header fields by hand; every field a script computes
-- with is read through these checks, so a value out of range raises 'TDSTORE damaged: header
-- field <name> ...' (tdstore.StoreDamagedError naming the store and the field) before anything
-- is read or written, never a raw Lua error, a hang, a NaN or rows never written.
local TDS_MAXINT = 9007199254740992  -- 2^53: every counter and size stays an exact double

-- Raise 'TDSTORE damaged' for header field 'name' holding 'v' (shown cut to 40 characters).
local function tds_bad_field(name, v, want)
  local shown = tostring(v)
  if #shown > 40 then
    shown = string.sub(shown, 1, 40) .. '...'
  end
  tds_damaged('header field ' .. name .. " holds '" .. shown .. "', not " .. want)
end

-- Header field 'name' (its raw value v, false/nil when absent) as an integer in lo..hi: plain
-- decimal digits as HINCRBY and '%.0f' write them (no sign '+', no leading zero, no '-0': fields
-- like 'version' are compared as strings); 'default' when absent (nil: required).
local function tds_int_field(v, name, lo, hi, default)
  if not v then
    if default ~= nil then
      return default
    end
    tds_bad_field(name, '', 'present')
  end
  local n = string.match(v, '^%-?%d+$') and tonumber(v) or nil
  if n == nil or n < lo or n > hi or string.format('%.0f', n) ~= v or v == '-0' then
    tds_bad_field(name, v, string.format('an integer in %.0f..%.0f', lo, hi))
  end
  return n
end

-- Header field 'name' as a finite number in lo..hi ('default' when absent).
local function tds_float_field(v, name, lo, hi, default)
  if not v then
    if default ~= nil then
      return default
    end
    tds_bad_field(name, '', 'present')
  end
  local n = tonumber(v)
  if n == nil or n ~= n or n < lo or n > hi or n >= math.huge or n <= -math.huge then
    tds_bad_field(name, v, string.format('a finite number in %.17g..%.17g', lo, hi))
  end
  return n
end

-- A finite number in lo..hi, else nil (a value decoded from JSON: cjson.null is not a number).
local function tds_finite(x, lo, hi)
  if type(x) ~= 'number' or x ~= x or x < lo or x > hi or x >= math.huge or x <= -math.huge then
    return nil
  end
  return x
end

-- The ring's sampling policy, header field 'sc' (raw value v; nil when absent), decoded and
-- checked as tdstore/_format/sampling_policy.py writes it: alpha in 0..1e300, mt an integer in 1..2^32-1,
-- limit {spi >= 0, min_size an integer >= 0, min_diff <= max_diff}, queue a boolean.
local function tds_policy(v)
  if not v then
    return nil
  end
  local ok, p = pcall(cjson.decode, v)
  local good = ok and type(p) == 'table' and string.sub(v, 1, 1) == '{'
  if good then
    for k in pairs(p) do
      if k ~= 'alpha' and k ~= 'mt' and k ~= 'limit' and k ~= 'queue' then
        good = false
      end
    end
  end
  if good and p.alpha ~= nil and tds_finite(p.alpha, 0, 1e300) == nil then
    good = false
  end
  if good and p.mt ~= nil and (tds_finite(p.mt, 1, 4294967295) == nil or p.mt ~= math.floor(p.mt)) then
    good = false
  end
  if good and p.queue ~= nil and type(p.queue) ~= 'boolean' then
    good = false
  end
  local lim = nil
  if good then
    lim = p.limit
  end
  if lim ~= nil then
    good = type(lim) == 'table' and #lim == 4 and tds_finite(lim[1], 0, 1e300) ~= nil and tds_finite(lim[2], 0, TDS_MAXINT) ~= nil
      and lim[2] == math.floor(lim[2]) and tds_finite(lim[3], -1e300, 1e300) ~= nil and tds_finite(lim[4], -1e300, 1e300) ~= nil
      and lim[3] <= lim[4]
  end
  if not good then
    tds_bad_field('sc', v, 'a sampling policy (JSON: alpha, mt, limit, queue in range)')
  end
  return p
end

-- Check that the offsets 'first' and 'last' (entry lo and a later one of the offset table 'key')
-- do not decrease and stay below 2^53, before the bytes between them are read: a table edited by
-- hand is reported, never cut into rows. The entries between are checked by the client, which
-- compares every element's size with the bytes read (tdstore/_plan/read_results.py check_elements).
local function tds_bounds_rise(key, first, last, lo)
  if last < first or last > TDS_MAXINT then
    tds_damaged('the offset table ' .. key .. ' decreases or passes 2^53 from entry ' .. string.format('%.0f', lo) .. ' (written by another client?)')
  end
end

-- 'count' as created: a ring op computes slots modulo the header's count, so a count edited to
-- another integer would address other slots. The data a ring op reads or writes was made for the
-- count: 'key' (segment 'seg' of 'per' elements, nil: one segment) holds (elements + extra) * nb
-- bytes when it exists (a key never allocated is absent). Checked once per key a call touches.
local function tds_count_agrees(checked, key, count, per, seg, nb, extra)
  if checked[key] or nb <= 0 then
    return
  end
  checked[key] = true
  local have = redis.call('STRLEN', key)
  local n = per and math.min(per, count - seg * per) or count
  if have > 0 and have ~= (n + extra) * nb then
    tds_bad_field('count', string.format('%.0f', count), 'the count its data was made for (' .. key .. ' holds ' .. have .. ' bytes, ' .. nb .. ' per element)')
  end
end

-- The ring fields of a header, raw as HMGET gives them: count (0..2^53, at least 1 once the
-- ring was written) and rw (0..2^53; absent: 0).
local function tds_ring_fields(count, rw)
  local c, w = tds_int_field(count, 'count', 0, TDS_MAXINT), tds_int_field(rw, 'rw', 0, TDS_MAXINT, 0)
  if c < 1 and w > 0 then
    tds_bad_field('count', count, 'at least 1 in a ring that was written')
  end
  return c, w
end

-- The check of KEYS[n] in a checks table (write.lua ARGV[6], commit.lua ARGV[4], built by
-- tdstore/_format/integrity.py): code (1: a heterogeneous leaf's data, at least the last offset of its
-- offset table KEYS[aux]; 2: exactly 'length' bytes), length, aux; nil when the table has none.
local function tds_expected(checks, n)
  local p = 24 * (n - 1)
  if #checks < p + 24 then
    return nil
  end
  return tds_u64(checks, p + 1), tds_u64(checks, p + 9), tds_u64(checks, p + 17)
end

-- The last offset of an offset table of 'olen' bytes (0 for none); read(from, to) returns its
-- bytes from..to, as GETRANGE does.
local function tds_last_offset(olen, read)
  if olen < 8 then
    return 0
  end
  return tds_u64(read(olen - 8, olen - 1), 1)
end

-- Raise 'TDSTORE damaged' for 'key', which holds 'have' bytes where its header implies 'want'
-- (a heterogeneous leaf's data: where its offset table says at least 'want').
local function tds_short(key, have, want, het)
  tds_damaged(key .. ' holds ' .. have .. ' bytes; ' .. (het and 'its offset table says ' or 'the store header implies ') .. string.format('%.0f', want))
end

-- The inventory hash of the store whose header is 'meta', or nil when it keeps none.
local function tds_inventory(meta)
  local na = redis.call('HGET', meta, 'na')
  if na then
    tds_int_field(na, 'na', 0, TDS_MAXINT)  -- counted with HINCRBY: an integer, checked before any write
    return KEYS[2]
  end
  return nil
end

-- Whether the absent 'key' was never allocated: only an inventory that is whole (as many
-- entries as the header counts) and does not list the key can say so.
local function tds_unallocated(meta, key)
  local inv = tds_inventory(meta)
  if inv == nil or redis.call('EXISTS', key) == 1 or redis.call('HEXISTS', inv, key) == 1 then
    return false
  end
  return redis.call('HLEN', inv) == tds_int_field(redis.call('HGET', meta, 'na'), 'na', 0, TDS_MAXINT)
end

-- The shape record of an element never written, 'rec' bytes: the inner batch dims, then zeros
-- (an element of no bytes; a non-tensor element of no bytes reads as None).
local function tds_empty_record(meta, rec)
  local raw = redis.call('HGET', meta, 'inner') or '[]'
  local ok, inner = pcall(cjson.decode, raw)
  if not ok or type(inner) ~= 'table' then
    tds_bad_field('inner', raw, 'a JSON list of sizes')
  end
  for i = 1, rec / 8 do
    if inner[i] ~= nil and (tds_finite(inner[i], 0, TDS_MAXINT) == nil or inner[i] ~= math.floor(inner[i])) then
      tds_bad_field('inner', raw, 'a JSON list of sizes')
    end
  end
  local parts = {}
  for i = 1, rec / 8 do
    parts[i] = tds_p64(inner[i] or 0)
  end
  return table.concat(parts)
end

-- What a key never allocated holds: 'len' zero bytes, or for a shape table ('rec' bytes per
-- record) 'len' bytes of empty records.
local function tds_blank(meta, len, rec)
  if rec ~= nil and rec > 0 then
    return string.rep(tds_empty_record(meta, rec), len / rec)
  end
  return string.rep('\0', len)
end

-- 'got', the bytes GETRANGE returned for 'len' bytes of 'key', when they are whole. A key never
-- allocated reads as tds_blank; anything else short raises 'TDSTORE damaged'. 'strict' (a
-- heterogeneous leaf's data, whose offsets say the bytes are there) never reads as blank.
local function tds_whole(meta, key, got, len, strict, rec)
  if #got == len then
    return got
  end
  if not strict and tds_unallocated(meta, key) then
    return tds_blank(meta, len, rec)
  end
  tds_damaged(key .. ' holds fewer bytes than the store header implies (lost or cut short)')
end

-- Record in the inventory that 'key' holds data now / holds none any more.
local function tds_record(meta, inv, key)
  if inv ~= nil and redis.call('HSETNX', inv, key, '1') == 1 then
    redis.call('HINCRBY', meta, 'na', 1)
  end
end

local function tds_forget(meta, inv, key)
  if inv ~= nil and redis.call('HDEL', inv, key) == 1 then
    redis.call('HINCRBY', meta, 'na', -1)
  end
end

-- Read a number from ARGV, raising a script error (before any write) when it is not one.
local function tds_num(v, what)
  local n = tonumber(v)
  if n == nil then
    error('TDSTORE bad argument: ' .. what .. ' is not a number')
  end
  return n
end

-- Give KEYS[first..last] a time to live of ttl milliseconds, or none when ttl is 0: every key
-- of a store gets the same absolute deadline (read from TIME once: Redis 6 does not stop its
-- clock inside a script, so relative PEXPIREs a millisecond apart would differ). 'at', when
-- given (a non-empty string), is that deadline in Unix milliseconds: a spread store's calls on
-- several nodes all use the one the client read from the header's node.
local function tds_expire_keys(first, last, ttl, at)
  local deadline = nil
  if ttl > 0 and at ~= nil and at ~= '' then
    deadline = tds_num(at, 'deadline')
  elseif ttl > 0 then
    local now = redis.call('TIME')
    deadline = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000) + ttl
  end
  for i = first, last do
    if deadline then
      redis.call('PEXPIREAT', KEYS[i], deadline)
    else
      redis.call('PERSIST', KEYS[i])
    end
  end
end

-- The segment of element 'row' and its index inside that segment, for ops addressed by
-- rows: a 'Q' op gives 'per', the elements per segment (nil: the store has one segment).
local function tds_locate(row, per)
  if per == nil then
    return 0, row
  end
  local seg = math.floor(row / per)
  return seg, row - seg * per
end

-- The 'Q' op at ARGV[a]: elements per segment for the row-addressed ops after it, which
-- must not have picked their rows yet ('rows' is nil until a 'U', 'I', 'W' or 'G' op).
local function tds_segment_length(a, rows)
  if rows ~= nil then
    error('TDSTORE bad argument: Q op after the op that picks the rows')
  end
  return tds_num(ARGV[a + 1], 'segment length')
end

-- KEYS[first + seg]: the key of segment 'seg' in a block of one key per segment.
local function tds_segkey(first, seg)
  local k = KEYS[first + seg]
  if k == nil then
    error('TDSTORE bad argument: no key for segment ' .. seg)
  end
  return k
end

-- The ring write count every ring call works with (lua/README.md, "The ring keeps one counter
-- per store"): the header's 'rw' ('rw_raw', a number). A store that holds data the ring never
-- wrote ('rw' 0 or absent: written by index, or filled otherwise) is a full ring of 'count'
-- slots, each written once: count. A store whose keys hold no data yet (a ring before its
-- first extend, a from_schema store) has written nothing: 0. Holding data: an inventory
-- ('na') that lists a key; a store without one (no inventory kept) holds data when it has keys.
local function tds_ring_rw(meta, count, rw_raw)
  if rw_raw > 0 then
    return rw_raw
  end
  local f = redis.call('HMGET', meta, 'na', 'schema')
  local holds
  if f[1] then
    holds = tds_int_field(f[1], 'na', 0, TDS_MAXINT) > 0
  else
    holds = f[2] ~= nil and not string.find(f[2], '"leaves":[]', 1, true)
  end
  if holds then
    return count
  end
  return 0
end

-- Bytes from..to (1-based, inclusive) of s: s itself when that is all of it. A Lua string of
-- a large value costs the server far more than its copy (about 1.2 us per KiB on Redis 7, as the
-- allocation drives Lua's garbage collector), so a write of one run never makes a second one.
local function tds_part(s, from, to)
  if from == 1 and to == #s then
    return s
  end
  return string.sub(s, from, to)
end

-- Request ids (see lua/README.md, "Request ids"). A call that changes state and is not naturally
-- idempotent (a ring write, a counted sample, a pop, update_priority, a policy change) carries an id
-- the client made for its operation and sends with every attempt of it. The script records what
-- the call decided (never row data) under that id in the store's reply cache, a hash under the
-- header's hash tag: field <id> -> decision, and bookkeeping fields that start with '#' (an id is
-- hex): '#' counts the records ever made, '#<k>' holds '<id> <bytes>' of record k (mod
-- TDS_REPLIES), '#o' the oldest record kept, '#b' the bytes of the decisions kept. The oldest records go once more
-- than TDS_REPLIES are kept or their decisions exceed TDS_REPLY_BYTES (the newest always stays).
-- A resend of a recorded id (redis-py retrying after a lost reply) gets the first reply back,
-- built from the record, and changes nothing. Nothing is recorded for STALE, GONE or WAIT.
local TDS_REPLIES, TDS_REPLY_BYTES = 4096, 4194304

-- The request of a call: KEYS[k] is the reply cache, 'rid' the id (hex, 16 to 64 digits). 'seen'
-- is the decision recorded under it by an earlier attempt, or nil.
local function tds_request(k, rid)
  local key = KEYS[tds_num(k, 'key index')]
  if key == nil or type(rid) ~= 'string' or #rid < 16 or #rid > 64 or not string.find(rid, '^%x+$') then
    error('TDSTORE bad argument: request id')
  end
  -- one read: the record, and the bookkeeping tds_remember needs (the script runs atomically)
  local got = redis.call('HMGET', key, rid, '#', '#o', '#b')
  local n = tds_int_field(got[2], 'reply cache #', 0, TDS_MAXINT, 0)
  local oldest = tds_int_field(got[3], 'reply cache #o', 1, n + 1, 1)
  if n - oldest >= TDS_REPLIES then  -- tds_remember keeps fewer records than that: edited by hand
    tds_bad_field('reply cache #o', got[3], 'within ' .. TDS_REPLIES .. ' records of #')
  end
  return {key = key, rid = rid, seen = got[1] or nil, n = n, oldest = oldest,
          bytes = tds_int_field(got[4], 'reply cache #b', 0, TDS_MAXINT, 0)}
end

-- Record 'decision' under the request's id (nothing without a request), dropping the oldest
-- records past the bounds. A cache the call creates gets the header's deadline, if any.
local function tds_remember(req, decision)
  if req == nil then
    return
  end
  local key = req.key
  local n = req.n + 1
  local slot = '#' .. string.format('%.0f', n % TDS_REPLIES)
  local oldest, bytes = req.oldest, req.bytes + #decision
  while oldest < n and (n - oldest >= TDS_REPLIES or bytes > TDS_REPLY_BYTES) do
    local old = redis.call('HGET', key, '#' .. string.format('%.0f', oldest % TDS_REPLIES))  -- '<id> <bytes>'
    if old then
      local rid, size = string.match(old, '^(%x+) (%d+)$')
      if rid == nil then
        tds_bad_field('reply cache record', old, "'<request id> <bytes>'")
      end
      redis.call('HDEL', key, rid)
      bytes = bytes - tonumber(size)
    end
    oldest = oldest + 1
  end
  redis.call('HSET', key, slot, req.rid .. ' ' .. #decision, req.rid, decision, '#', string.format('%.0f', n),
             '#o', string.format('%.0f', oldest), '#b', string.format('%.0f', bytes))
  if n == 1 then
    local at = tds_deadline_of(KEYS[1])
    if at > 0 then
      redis.call('PEXPIREAT', key, at)
    end
  end
end

-- A string of '1'/'0' flags (rows applied or not) as run lengths, '1' runs first ('5 0 3' is
-- '11111' then '000'... alternating), and back: a record stays small when most rows agree.
local function tds_runs(flags)
  local out, pos, pattern = {}, 1, '^1*'
  while pos <= #flags do
    local _, e = string.find(flags, pattern, pos)
    out[#out + 1] = string.format('%d', e - pos + 1)
    pos = e + 1
    pattern = pattern == '^1*' and '^0*' or '^1*'
  end
  return table.concat(out, ' ')
end

local function tds_unruns(runs)
  local parts, c = {}, '1'
  for n in string.gmatch(runs, '%d+') do
    parts[#parts + 1] = string.rep(c, tonumber(n))
    c = c == '1' and '0' or '1'
  end
  return table.concat(parts)
end

-- The absolute deadline (Unix ms) of a time to live of 'ttl' ms, nil for none; 'at' (ARGV, may
-- be '' or nil) is that deadline already read by an earlier batch of the same call.
local function tds_deadline(ttl, at)
  if ttl <= 0 then
    return nil
  end
  if at ~= nil and at ~= '' then
    return tds_num(at, 'deadline')
  end
  return tds_now_ms() + ttl
end

-- Give KEYS[first..last] the absolute deadline 'deadline' (Unix ms), or none when nil.
local function tds_expire_at(first, last, deadline)
  for i = first, last do
    if deadline then
      redis.call('PEXPIREAT', KEYS[i], deadline)
    else
      redis.call('PERSIST', KEYS[i])
    end
  end
end

-- The first batch of a whole-store deadline change cut in batches (expire.lua, commit.lua): the
-- header 'meta' takes the later of its current deadline and the new one (none if either is
-- none), so it outlives every key, whichever batch a client dying half-way reached; its field
-- 'xd' records the earlier one, when a key may start to vanish (tds_lapsed: from then on the
-- store reads as GONE, never as damaged or zeros). The last batch calls tds_ttl_end.
local function tds_ttl_begin(meta, deadline)
  local left = redis.call('PTTL', meta)
  local old = nil
  if left > 0 then
    -- the deadline itself where the server says it (PEXPIRETIME, Redis 7+); else the clock plus
    -- PTTL, which a script crossing a millisecond may put 1 ms late
    local at = redis.pcall('PEXPIRETIME', meta)
    old = (type(at) == 'number' and at > 0) and at or (tds_now_ms() + left)
  end
  if old == nil or deadline == nil then
    redis.call('PERSIST', meta)
  else
    redis.call('PEXPIREAT', meta, math.max(old, deadline))
  end
  -- a batch restarted after STALE: keys the first try did not reach may still hold its 'xd'
  local early = tonumber(redis.call('HGET', meta, 'xd') or '')
  for _, d in ipairs({old or false, deadline or false}) do
    if d and (early == nil or d < early) then
      early = d
    end
  end
  if early ~= nil then
    redis.call('HSET', meta, 'xd', string.format('%.0f', early))
  end
end

-- The last batch: the header takes the new deadline and drops 'xd'.
local function tds_ttl_end(meta, deadline)
  redis.call('HDEL', meta, 'xd')
  if deadline then
    redis.call('PEXPIREAT', meta, deadline)
  else
    redis.call('PERSIST', meta)
  end
end


-- Raise 'TDSTORE out of memory' (before any write) when the call would leave a server that does
-- not evict past its maxmemory: Redis checks maxmemory only when a script starts, so one call
-- could otherwise overshoot it by all it allocates. The server after the call holds what it holds
-- now (used_memory), less the call's own arguments, plus the 'allocated' bytes the call allocates.
-- used_memory counts the arguments while the call runs (the client's argv, and for a call inside
-- MULTI every command queued with it), and the server frees them when the call returns: counting
-- them would refuse, near the limit, a write whose data fits (a ring extend's rows were counted
-- once in flight and once in the segment they fill). 'extra': bytes of the commands queued with
-- the call in its transaction (direct.lua's SETRANGEs), which the script cannot see.
local function tds_room(allocated, extra)
  local info = redis.pcall('INFO', 'memory')
  if type(info) == 'string' then
    local used = tonumber(string.match(info, 'used_memory:(%d+)'))
    local max = tonumber(string.match(info, 'maxmemory:(%d+)'))
    local policy = string.match(info, 'maxmemory_policy:([%w%-]+)')
    if used and max and max > 0 and policy == 'noeviction' then
      local own = extra or 0
      for i = 1, #ARGV do
        own = own + #ARGV[i]
      end
      for i = 1, #KEYS do
        own = own + #KEYS[i]
      end
      local after = math.max(used - own, 0) + allocated
      if after > max then
        error('TDSTORE out of memory: the call would allocate ' .. string.format('%.0f', allocated) .. ' bytes; the server uses ' ..
              string.format('%.0f', used) .. ' of its maxmemory ' .. string.format('%.0f', max) .. ', ' .. string.format('%.0f', own) ..
              ' of them the call\'s own arguments (freed when it returns): it would hold ' .. string.format('%.0f', after))
      end
    end
  end
end

-- Swap in a new schema: the JSON 'schema', the guard fields 'guards' sets ('name=value' words,
-- 'kv=7 lv:3=7 lv:5=-'; '-' deletes the field), and 'version' one up. The caller checked the
-- exact version first (a schema is planned from the one it replaces).
local function tds_set_schema(meta, schema, guards)
  redis.call('HSET', meta, 'schema', schema)
  for name, value in string.gmatch(guards, '([%w:]+)=([%d%-]+)') do
    if value == '-' then
      redis.call('HDEL', meta, name)
    else
      redis.call('HSET', meta, name, value)
    end
  end
  redis.call('HINCRBY', meta, 'version', 1)
end

-- The store's stats hash (StoreKeys.stats; lua/README.md "Stats"): counters of the ring's work,
-- added by the scripts that do it, in the same call. A script sets 'key' (read.lua and write.lua
-- from an 'A' op, direct.lua and ack.lua from their last KEYS); nil: the call is not counted (a
-- read-only handle's). Counting never fails a call (redis.pcall: a server at its maxmemory, an ACL
-- without HINCRBY), and a field counted for the first time gives the hash the store's deadline.
local tds_stats = {key = nil, held = 0}  -- held: ms the call was held back before this try (the 'A' op's)
local function tds_stat(field, n)
  local key = tds_stats.key
  if key == nil or n == 0 then
    return
  end
  if redis.pcall('HINCRBY', key, field, string.format('%.0f', n)) == n then
    local at = tds_deadline_of(KEYS[1])
    if at > 0 then
      redis.pcall('PEXPIREAT', key, at)
    end
  end
end

-- The stats hash's 'field' raised to 'v' when lower (a maximum: the oldest row sampled).
local function tds_stat_max(field, v)
  local key = tds_stats.key
  if key ~= nil and v > (tonumber(redis.pcall('HGET', key, field)) or -1) then
    redis.pcall('HSET', key, field, string.format('%.0f', v))
  end
end

-- Count sampled 'rows' (slots) of a ring of 'count' slots at ring write count 'rw': how many
-- ('smp'), and their age in ring writes (the row in slot s was written by ring write w, the
-- last below rw with w % count == s: it is (rw - 1 - s) % count writes old), summed and the largest.
local function tds_stat_rows(rows, rw, count)
  local sum, most = 0, -1
  for j = 1, #rows do
    local age = (rw - 1 - rows[j]) % count
    sum = sum + age
    if age > most then
      most = age
    end
  end
  tds_stat('smp', #rows)
  tds_stat('age_sum', sum)
  if most >= 0 then
    tds_stat_max('age_max', most)
  end
end
