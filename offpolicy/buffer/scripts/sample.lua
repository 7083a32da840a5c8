-- Sample k groups atomically: return expired leases, drop (and count) stale groups, apply the rate
-- limiter, choose by the sampler, then either consume each chosen group (count the use; remove it at
-- max_times_sampled) or lease it to a consumer (a lease id per chosen group, with a deadline; the use
-- counts when acked, lease.lua). No payload passes through Lua: the i-th chosen group's payload is put
-- at out_prefix .. i (RENAMEd there when the group leaves the buffer with this use, O(1); COPYed when it
-- stays), and the client's MULTI/EXEC around this script reads those k keys with one MGET and deletes
-- them: one round trip.
-- ARGV: k, consumer_version, max_staleness (-1 = none), max_times_sampled (0 = none), sampler, seed,
--       min_size_to_sample, use_ratio (0|1), samples_per_insert, min_diff, priority_epsilon,
--       payload_prefix, out_prefix (unique to the call), consumer ('' = consume), lease_ms,
--       consumer_prefix (per-consumer lease sets: consumer_prefix .. consumer), priority_alpha,
--       image_grace_ms (an image only consumed groups named expires this long after, so that the caller
--       can read it: `ReplayBuffer.images`)
-- Returns: {status, size, n_stale, n_consumed, n_expired, then the chosen group ids, then (lease) their
--   lease ids}. status: 1 ok, 2 rate limited (ratio), 3 below min_size_to_sample, 4 fewer than k
--   eligible groups, 5 more stale groups left to drop than one call drops (the client calls again).
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
local consumer, lease_ms, consumer_prefix = ARGV[14], tonumber(ARGV[15]), ARGV[16]
local alpha = tonumber(ARGV[17] or '1')
local image_grace = tonumber(ARGV[18] or '0')
local STALE_CHUNK = 2000  -- stale groups dropped per call (the rest: status 5, the client calls again)

run_even_at_maxmemory()
local now = now_ms()
local n_expired = expire_leases(now, max_times, consumer_prefix)

-- 1. Drop groups a consumer at consumer_version may no longer use (bounded per call).
local n_stale = 0
if max_staleness >= 0 then
  local stale = redis.call('ZRANGEBYSCORE', K.byver, '-inf', '(' .. (consumer_version - max_staleness),
    'LIMIT', 0, STALE_CHUNK)
  retire(stale, payload_prefix, false)
  n_stale = #stale
  if n_stale > 0 then redis.call('HINCRBY', K.counters, 'dropped:stale', n_stale) end
  if n_stale == STALE_CHUNK then
    return {5, redis.call('ZCARD', K.order) + redis.call('HLEN', K.held), n_stale, 0, n_expired}
  end
end

-- 2. Rate limiters (Reverb's MinSize and SampleToInsertRatio; uses = acked + outstanding leases).
local size = redis.call('ZCARD', K.order)  -- sampleable groups
local stored = size + redis.call('HLEN', K.held)
if size < min_size then return {3, stored, n_stale, 0, n_expired} end
if use_ratio then
  local sampled = tonumber(redis.call('HGET', K.counters, 'sampled') or '0')
  local inserted = tonumber(redis.call('HGET', K.counters, 'inserted') or '0')
  if inserted * spi - (sampled + redis.call('HLEN', K.leases) + k) < min_diff then
    return {2, stored, n_stale, 0, n_expired}
  end
end
if size < k then return {4, stored, n_stale, 0, n_expired} end
-- `prioritized` chooses among the groups with a priority (those inserted while it was the sampler)
if sampler == 'prioritized' and redis.call('ZCARD', K.prio) < k then return {4, stored, n_stale, 0, n_expired} end

-- 3. Choose k distinct groups (every indexed group is eligible after step 1): samplers.lua.
local chosen = choose(sampler, k, size, consumer_version, eps, alpha)

-- 4. Consume or lease each chosen group, and hand its payload to the caller's out key. A payload that is
-- gone (deleted behind the buffer's back, e.g. by maxmemory eviction) leaves its out key empty: that
-- group is removed, counted as dropped `payload_missing`, and not leased (the caller skips it).
local used, leased = {}, {}
if max_times ~= 1 then  -- with max_times 1 an indexed group has no uses and no leases
  used, leased = multi('HMGET', K.uses, chosen), multi('HMGET', K.leased, chosen)
end
local out = {1, 0, n_stale, 0, n_expired}
local retired, missing, to_hold, set_uses, set_leased, lease_ids = {}, {}, {}, {}, {}, {}
local leasing = consumer ~= ''
local seq = 0
if leasing then seq = redis.call('HINCRBY', K.counters, 'lease_seq', k) - k end
local records, deadlines, mine = {}, {}, {}
for i, gid in ipairs(chosen) do
  local n_used, n_leased = tonumber(used[i] or '0'), tonumber(leased[i] or '0')
  local key = payload_prefix .. gid
  if leasing then n_leased = n_leased + 1 else n_used = n_used + 1 end
  local full = max_times > 0 and n_used + n_leased >= max_times
  local ok
  if full and n_leased == 0 then
    -- RENAME of a missing key is an error reply ({err = ...}), caught: nothing else is undone
    ok = not redis.pcall('RENAME', key, out_prefix .. i).err
    if ok then retired[#retired + 1] = gid end
  else
    ok = redis.call('COPY', key, out_prefix .. i) == 1
    if ok then
      if full then to_hold[#to_hold + 1] = gid end
      if leasing then
        local id = tostring(seq + i)
        lease_ids[i] = id
        records[#records + 1] = id
        records[#records + 1] = consumer .. ' ' .. gid
        deadlines[#deadlines + 1] = now + lease_ms
        deadlines[#deadlines + 1] = id
        mine[#mine + 1] = id
        set_leased[#set_leased + 1] = gid
        set_leased[#set_leased + 1] = n_leased
      else
        set_uses[#set_uses + 1] = gid
        set_uses[#set_uses + 1] = n_used
      end
    end
  end
  if not ok then missing[#missing + 1] = gid end
  out[#out + 1] = gid
end
if leasing then
  for i = 1, #chosen do out[#out + 1] = lease_ids[i] or '' end
end
variadic('HSET', K.uses, set_uses)  -- chunks of 1000: whole (field, value) pairs
variadic('HSET', K.leased, set_leased)
variadic('HSET', K.leases, records)
variadic('ZADD', K.deadlines, deadlines)
variadic('SADD', consumer_prefix .. consumer, mine)
hold(to_hold)
retire(retired, payload_prefix, true, image_grace)
retire(missing, payload_prefix, false)
local n_served = #chosen - #missing
if leasing then
  redis.call('HINCRBY', K.counters, 'leased', n_served)
else
  redis.call('HINCRBY', K.counters, 'sampled', k)  -- as before leases: a missing payload's use counts
end
if #retired > 0 then redis.call('HINCRBY', K.counters, 'evicted:max_times_sampled', #retired) end
if #missing > 0 then redis.call('HINCRBY', K.counters, 'dropped:payload_missing', #missing) end
out[2] = stored - #retired - #missing
out[4] = #retired
return out
