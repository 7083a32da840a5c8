-- Sample k groups atomically: drop (and count) stale groups, apply the rate limiter, choose by the
-- sampler, count each use, remove groups sampled max_times_sampled times. No payload passes through
-- Lua: the i-th chosen group's payload is put at out_prefix .. i (RENAMEd there when the group leaves
-- the buffer, O(1); COPYed when it stays), and the client's MULTI/EXEC around this script reads those k
-- keys with one MGET and deletes them: one round trip, and a removed group's payload is gone at once.
-- KEYS: order by_version uses priority seen counters  (all under one {run_id} hash tag)
-- ARGV: k, consumer_version, max_staleness (-1 = none), max_times_sampled (0 = none), sampler, seed,
--       min_size_to_sample, use_ratio (0|1), samples_per_insert, min_diff, priority_epsilon,
--       payload_prefix, out_prefix (unique to the call)
-- Returns: {status, size, n_stale, n_consumed, then the chosen group ids}
--   status: 1 ok, 2 rate limited (ratio), 3 below min_size_to_sample, 4 fewer than k eligible groups
local order, byver, uses, prio, counters = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[6]
local k = tonumber(ARGV[1])
local consumer_version = tonumber(ARGV[2])
local max_staleness = tonumber(ARGV[3])
local max_times = tonumber(ARGV[4])
local sampler = ARGV[5]
-- Redis 6.2 reseeds the script PRNG identically on every call; the client passes a fresh seed.
math.randomseed(tonumber(ARGV[6]))
local min_size = tonumber(ARGV[7])
local use_ratio = ARGV[8] == '1'
local spi = tonumber(ARGV[9])
local min_diff = tonumber(ARGV[10])
local eps = tonumber(ARGV[11])
local payload_prefix, out_prefix = ARGV[12], ARGV[13]

-- Every redis.call costs a few microseconds of its own: variadic commands, 1000 members per call.
local function variadic(cmd, key, members)
  for i = 1, #members, 1000 do
    if key then
      redis.call(cmd, key, unpack(members, i, math.min(i + 999, #members)))
    else
      redis.call(cmd, unpack(members, i, math.min(i + 999, #members)))
    end
  end
end

-- Take removed groups out of every index (their payloads: the caller's business).
local function unindex(gids)
  if #gids == 0 then return end
  variadic('ZREM', order, gids)
  variadic('ZREM', byver, gids)
  variadic('ZREM', prio, gids)
  variadic('HDEL', uses, gids)
end

-- 1. Drop groups a consumer at consumer_version may no longer use.
local n_stale = 0
if max_staleness >= 0 then
  local stale = redis.call('ZRANGEBYSCORE', byver, '-inf', '(' .. (consumer_version - max_staleness))
  unindex(stale)
  local stale_keys = {}
  for i, gid in ipairs(stale) do stale_keys[i] = payload_prefix .. gid end
  variadic('DEL', nil, stale_keys)
  n_stale = #stale
  if n_stale > 0 then redis.call('HINCRBY', counters, 'dropped:stale', n_stale) end
end

-- 2. Rate limiters (Reverb's MinSize and SampleToInsertRatio).
local size = redis.call('ZCARD', order)
if size < min_size then return {3, size, n_stale, 0} end
if use_ratio then
  local inserted = tonumber(redis.call('HGET', counters, 'inserted') or '0')
  local sampled = tonumber(redis.call('HGET', counters, 'sampled') or '0')
  if inserted * spi - (sampled + k) < min_diff then return {2, size, n_stale, 0} end
end
if size < k then return {4, size, n_stale, 0} end

-- 3. Choose k distinct groups (every stored group is eligible after step 1).
local chosen = {}
if sampler == 'fifo' then
  chosen = redis.call('ZRANGE', order, 0, k - 1)
elseif sampler == 'newest' then
  chosen = redis.call('ZREVRANGE', order, 0, k - 1)
elseif sampler == 'uniform' then
  -- Floyd's algorithm: k distinct ranks out of size, uniformly.
  local picked = {}
  for j = size - k + 1, size do
    local t = math.random(1, j)
    if picked[t] then t = j end
    picked[t] = true
    chosen[#chosen + 1] = redis.call('ZRANGE', order, t - 1, t - 1)[1]
  end
else
  -- Weighted without replacement (Efraimidis-Spirakis): the k largest log(u)/w.
  local rows
  if sampler == 'staleness_weighted' then
    rows = redis.call('ZRANGE', byver, 0, -1, 'WITHSCORES')
  else
    rows = redis.call('ZRANGE', prio, 0, -1, 'WITHSCORES')
  end
  local keyed = {}
  for i = 1, #rows, 2 do
    local w
    if sampler == 'staleness_weighted' then
      w = 1.0 / (math.max(consumer_version - tonumber(rows[i + 1]), 0) + 1)
    else
      w = tonumber(rows[i + 1]) + eps
    end
    local key = -math.huge
    if w > 0 then key = math.log(1.0 - math.random()) / w end
    keyed[#keyed + 1] = {key, rows[i]}
  end
  table.sort(keyed, function(a, b) return a[1] > b[1] end)
  for i = 1, k do chosen[i] = keyed[i][2] end
end

-- 4. Count uses, remove groups that reached max_times_sampled, hand each payload to the caller's
-- out key. A payload that is gone (deleted behind the buffer's back, e.g. by maxmemory eviction) leaves
-- its out key empty; it is counted here as dropped `payload_missing` (the caller skips it).
local out = {1, 0, n_stale, 0}
local counts = {}
if max_times ~= 1 then
  for i = 1, #chosen, 1000 do
    local part = redis.call('HMGET', uses, unpack(chosen, i, math.min(i + 999, #chosen)))
    for j, n in ipairs(part) do counts[i + j - 1] = n end  -- a missing field is false, not nil
  end
end
local retired, kept, n_missing = {}, {}, 0
for i, gid in ipairs(chosen) do
  local n_uses = tonumber(counts[i] or '0') + 1
  if max_times > 0 and n_uses >= max_times then
    retired[#retired + 1] = gid
    -- RENAME of a missing key is an error reply ({err = ...}), caught: nothing else is undone
    if redis.pcall('RENAME', payload_prefix .. gid, out_prefix .. i).err then n_missing = n_missing + 1 end
  else
    kept[#kept + 1] = gid
    kept[#kept + 1] = n_uses
    if redis.call('COPY', payload_prefix .. gid, out_prefix .. i) == 0 then n_missing = n_missing + 1 end
  end
  out[#out + 1] = gid
end
variadic('HSET', uses, kept)  -- chunks of 1000: whole (group_id, uses) pairs
unindex(retired)
redis.call('HINCRBY', counters, 'sampled', k)
if #retired > 0 then redis.call('HINCRBY', counters, 'evicted:max_times_sampled', #retired) end
if n_missing > 0 then redis.call('HINCRBY', counters, 'dropped:payload_missing', n_missing) end
out[2] = size - #retired
out[4] = #retired
return out
