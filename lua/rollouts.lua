--[[
  rollouts.lua: publish the learner's policy version on a ring (header field 'cv'), the version
  samples and pops with max_staleness measure rows against (see _rollouts.lua).

  The first call also turns the ring's rollout index on (header field 'ro', see _rollouts.lua):
  from then on every ring write stamps its rows, and samples and pops go through read.lua's 'G'
  op; 'kv' and 'version' move so that clients planning without it are answered STALE. Rows the ring holds already
  become visible rows of the version published before (at most 4,096: more is refused), and those no plain pop
  took are queued for pops.

  KEYS[1]     store header hash
  KEYS[2..6]  the rollout index (see _rollouts.lua: K.z, K.r, K.g, K.s, K.q)
  ARGV[1]     the epoch of the store the caller holds (another creation of the store answers GONE)
  ARGV[2]     the new version (an integer in 0..2^53)
  ARGV[3]     '1': a version lower than the published one is accepted; '0': refused
  ARGV[4]     the store's Pub/Sub channel ('' for none): writers waiting for the version (max_ahead) wake
  ARGV[5..9]  the KEYS indices of the rollout index ('2' .. '6')

  Reply       {'OK', previous version, kv}: kv after the call (the client keeps it in its header);
              {'GONE'} when the store is deleted, a tombstone or another creation.
  Errors      'TDSTORE bad argument' for a version that is not an integer in range;
              'TDSTORE refused' for a version going backwards without ARGV[3] = '1'.
  Resending   the version is absolute: a resend sets the same value (going backwards is
              only refused for a lower one). No reply cache is needed.
]]
local meta = KEYS[1]
local h = redis.call('HMGET', meta, 'epoch', 'version', 'state', 'cv', 'count', 'rw', 'rr', 'ro')
if h[1] ~= ARGV[1] or not h[2] or (h[3] and h[3] ~= 'ready') then
  return {'GONE'}
end
local count, rw = tds_ring_fields(h[5], h[6])
rw = tds_ring_rw(meta, count, rw)
if not h[8] then
  tds_ro.backfill_check(rw, count)
end
local v = tds_ro.int(ARGV[2], 'version')
local cv = tds_int_field(h[4], 'cv', 0, TDS_MAXINT, 0)
if v < cv and ARGV[3] ~= '1' then
  error('TDSTORE refused: version ' .. ARGV[2] .. ' is behind the published version ' .. tds_ro.fmt(cv)
    .. ' (set_version(v, allow_backwards=True) to move it back)')
end
tds_ro.turn_on(meta, tds_ro.keys(5), cv, rw, count, tds_int_field(h[7], 'rr', 0, rw, 0))
redis.call('HSET', meta, 'cv', ARGV[2])
if ARGV[4] ~= '' then
  redis.call('PUBLISH', ARGV[4], 'v')
end
return {'OK', tds_ro.fmt(cv), redis.call('HGET', meta, 'kv')}
