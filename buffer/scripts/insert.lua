-- Insert a batch of groups atomically: dedupe, index, count, evict past max_size (oldest first).
-- Runs inside the client's MULTI/EXEC, right after the SETs of every group's payload to its staging
-- key; no payload passes through Lua: an accepted group's staging key is RENAMEd to its payload key
-- (O(1)), a duplicate's or refused group's staging key is DELeted. Evicted payloads get a grace
-- PEXPIRE instead of a DEL (a consumer may have chosen the group and not fetched it yet).
-- KEYS: order by_version uses priority seen counters  (all under one {run_id} hash tag)
-- ARGV: max_size, use_ratio (0|1), samples_per_insert, max_diff, min_size_to_sample, use_priority (0|1),
--       payload_prefix, staging_prefix, grace_ms, then 3 per group: group_id, policy_version, priority
--       (per-group keys are prefix .. group_id: same hash tag, same Cluster slot)
-- Returns: {statuses (1 inserted, 0 duplicate, 2 rate limited), size, evicted_max_size, evicted_unsampled}
local order, byver, uses, prio, seen, counters = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local max_size = tonumber(ARGV[1])
local use_ratio = ARGV[2] == '1'
local spi = tonumber(ARGV[3])
local max_diff = tonumber(ARGV[4])
local min_size = tonumber(ARGV[5])
local use_priority = ARGV[6] == '1'
local payload_prefix, staging_prefix, grace_ms = ARGV[7], ARGV[8], ARGV[9]

local inserted = tonumber(redis.call('HGET', counters, 'inserted') or '0')
local sampled = tonumber(redis.call('HGET', counters, 'sampled') or '0')
local size = redis.call('ZCARD', order)
local statuses = {}
local n_new, n_dup, n_evicted, n_unsampled = 0, 0, 0, 0
local limited = false

for i = 10, #ARGV, 3 do
  local gid = ARGV[i]
  local status = 1
  if limited then
    status = 2
  elseif redis.call('SISMEMBER', seen, gid) == 1 then
    status = 0
    n_dup = n_dup + 1
  elseif use_ratio and size + 1 > min_size and (inserted + 1) * spi - sampled > max_diff then
    -- Reverb's SampleToInsertRatio: inserts may run ahead of samples by at most max_diff.
    limited = true
    status = 2
  end
  statuses[#statuses + 1] = status
  if status ~= 1 then
    redis.call('DEL', staging_prefix .. gid)
  else
    inserted = inserted + 1
    redis.call('SADD', seen, gid)
    local key = payload_prefix .. gid
    redis.call('RENAME', staging_prefix .. gid, key)
    redis.call('PERSIST', key)  -- the staging key's safety TTL
    redis.call('ZADD', order, inserted, gid)
    redis.call('ZADD', byver, ARGV[i + 1], gid)
    if use_priority then
      redis.call('ZADD', prio, ARGV[i + 2], gid)
    end
    size = size + 1
    n_new = n_new + 1
    while size > max_size do
      local old = redis.call('ZPOPMIN', order)[1]
      redis.call('ZREM', byver, old)
      redis.call('ZREM', prio, old)
      redis.call('PEXPIRE', payload_prefix .. old, grace_ms)
      if redis.call('HDEL', uses, old) == 0 then
        n_unsampled = n_unsampled + 1
      end
      size = size - 1
      n_evicted = n_evicted + 1
    end
  end
end

if n_new > 0 then redis.call('HSET', counters, 'inserted', inserted) end
if n_dup > 0 then redis.call('HINCRBY', counters, 'duplicates', n_dup) end
if n_evicted > 0 then redis.call('HINCRBY', counters, 'evicted:max_size', n_evicted) end
if n_unsampled > 0 then redis.call('HINCRBY', counters, 'dropped:evicted_unsampled', n_unsampled) end
return {statuses, size, n_evicted, n_unsampled}
