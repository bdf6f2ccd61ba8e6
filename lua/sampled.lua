--[[
  sampled.lua: count a full ring's uniform sample read as a transaction of GETRANGEs (lua/README.md
  "Stats"): the last command of that transaction, after a plain BITFIELD that set the rows' bits in
  the store's sampled-rows bitmap (cheaper there than from Lua), on a ring that tracks distinct rows
  (header 'sd', distinct.lua). A ring that does not ends its transaction with a plain 'HINCRBY smpx n'
  instead; when that made the field, the client calls this script with ARGV[1] = 0 (once per store
  lifetime, its own round trip) to give the hash the store's deadline or delete it for a store gone.

  A transaction cannot ask whether the store has a deadline, so this script is what gives the stats
  hash and the bitmap the store's deadline when the transaction created them (the first counted call
  of a store may be such a sample), and deletes a bitmap the BITFIELD made for a store that is gone.

  KEYS[1]     store header hash
  KEYS[2]     the store's stats hash (StoreKeys.stats)
  KEYS[3]     the store's sampled-rows bitmap (StoreKeys.sampled_rows)
  ARGV[1]     rows sampled; 0: count nothing, only fix the keys' deadlines (or delete them: store gone)

  Reply       {'OK'}; {'GONE'} when the store does not exist (nothing counted).
  Errors      'TDSTORE bad argument' when ARGV[1] is not a number.
]]
local meta, hash, bits = KEYS[1], KEYS[2], KEYS[3]
local n = tonumber(ARGV[1])
if n == nil then
  error('TDSTORE bad argument: row count ' .. tostring(ARGV[1]))
end
-- (no helper of _lib.lua: this runs after every such sample, and each helper costs a closure per call)
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local h = redis.call('HMGET', meta, 'version', 'state', 'xd', 'sd')
if not h[1] or h[2] == 'deleting' or (h[3] and tonumber(h[3]) and now_ms() >= tonumber(h[3])) then
  redis.call('DEL', bits)  -- made by this transaction's BITFIELD for no store (or one whose keys are being deleted)
  if n == 0 then
    redis.call('DEL', hash)  -- made by this transaction's HINCRBY
  end
  return {'GONE'}
end
if h[4] ~= '1' then
  redis.call('DEL', bits)  -- a stale handle's BITFIELD: the ring stopped tracking distinct rows
end
local at = nil
local function deadline()  -- the header's (Unix ms), -1 for none; PEXPIRETIME, or PTTL on Redis 6
  if at == nil then
    local got = redis.pcall('PEXPIRETIME', meta)
    if type(got) ~= 'number' then
      local ttl = redis.call('PTTL', meta)
      got = ttl > 0 and now_ms() + ttl or -1
    end
    at = got
  end
  return at
end
if n > 0 and redis.pcall('HINCRBY', hash, 'smpx', n) == n and deadline() > 0 then  -- the hash (or field) is new
  redis.pcall('PEXPIREAT', hash, at)
elseif n == 0 and redis.call('PTTL', hash) == -1 and deadline() > 0 then
  redis.pcall('PEXPIREAT', hash, at)
end
if redis.call('PTTL', bits) == -1 and deadline() > 0 then  -- the bitmap exists without the store's deadline
  redis.pcall('PEXPIREAT', bits, at)
end
return {'OK'}
