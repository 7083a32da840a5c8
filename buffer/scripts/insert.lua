-- Insert a batch of groups atomically: dedupe, index, count, evict past max_size (oldest first).
-- Runs inside the client's MULTI/EXEC, right after a `SET <payload key> <payload> NX` of every group:
-- no payload passes through Lua. A new group's payload is then already in place; NX left a stored
-- group's payload untouched, and the script DELetes the payload keys those SETs created for groups it
-- does not store (a duplicate whose original is gone, a group the ratio limiter refused).
-- KEYS: order by_version uses priority seen counters  (all under one {run_id} hash tag)
-- ARGV: max_size, use_ratio (0|1), samples_per_insert, max_diff, min_size_to_sample, use_priority (0|1),
--       payload_prefix, then 3 per group: group_id, policy_version, priority
--       (payload keys are payload_prefix .. group_id: same hash tag, same Cluster slot)
-- Returns: {statuses (1 inserted, 0 duplicate, 2 rate limited), size, evicted_max_size, evicted_unsampled}
-- Every redis.call costs a few microseconds of its own, so the indexes are written with one variadic
-- call each (the batch is at most a few hundred groups: the client splits larger ones).
local order, byver, uses, prio, seen, counters = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local max_size = tonumber(ARGV[1])
local use_ratio = ARGV[2] == '1'
local spi = tonumber(ARGV[3])
local max_diff = tonumber(ARGV[4])
local min_size = tonumber(ARGV[5])
local use_priority = ARGV[6] == '1'
local payload_prefix = ARGV[7]
local FIRST = 8

-- Variadic calls of at most 1000 members (unpack has a stack limit: an eviction after max_size was
-- lowered can remove many groups at once); returns the sum of the replies.
local function variadic(cmd, key, members)
  local n = 0
  for i = 1, #members, 1000 do
    local last = math.min(i + 999, #members)
    if key then
      n = n + redis.call(cmd, key, unpack(members, i, last))
    else
      n = n + redis.call(cmd, unpack(members, i, last))
    end
  end
  return n
end

local gids = {}
for i = FIRST, #ARGV, 3 do gids[#gids + 1] = ARGV[i] end
local was_seen = redis.call('SMISMEMBER', seen, unpack(gids))
local c = redis.call('HMGET', counters, 'inserted', 'sampled')
local inserted, sampled = tonumber(c[1] or '0'), tonumber(c[2] or '0')
local size = redis.call('ZCARD', order)

-- 1. Decide each group in batch order: duplicate, refused by the ratio limiter (and all after it), new.
local statuses, new, others, taken = {}, {}, {}, {}
local by_order, by_version, by_priority = {}, {}, {}
local n_dup, limited = 0, false
for j, gid in ipairs(gids) do
  local status = 1
  if limited then
    status = 2
  elseif was_seen[j] == 1 or taken[gid] then
    status = 0
    n_dup = n_dup + 1
  elseif use_ratio and math.min(size, max_size) + 1 > min_size and (inserted + 1) * spi - sampled > max_diff then
    -- Reverb's SampleToInsertRatio: inserts may run ahead of samples by at most max_diff.
    limited = true
    status = 2
  end
  statuses[j] = status
  if status == 1 then
    taken[gid] = true
    inserted = inserted + 1
    size = size + 1
    new[#new + 1] = gid
    local a = FIRST + 3 * (j - 1)
    by_order[#by_order + 1] = inserted
    by_order[#by_order + 1] = gid
    by_version[#by_version + 1] = ARGV[a + 1]
    by_version[#by_version + 1] = gid
    by_priority[#by_priority + 1] = ARGV[a + 2]
    by_priority[#by_priority + 1] = gid
  elseif not taken[gid] then
    -- Not stored by this batch (a duplicate, or refused): its payload key holds this transaction's SET
    -- unless the group is stored already (NX kept the stored payload), refused or not.
    others[#others + 1] = gid
  end
end

-- 2. Index the new groups; delete the payload keys of groups not stored.
if #new > 0 then
  redis.call('SADD', seen, unpack(new))
  redis.call('ZADD', order, unpack(by_order))
  redis.call('ZADD', byver, unpack(by_version))
  if use_priority then redis.call('ZADD', prio, unpack(by_priority)) end
  redis.call('HSET', counters, 'inserted', inserted)
end
if #others > 0 then
  local stored, unstored = redis.call('ZMSCORE', order, unpack(others)), {}
  for i, gid in ipairs(others) do
    if not stored[i] then unstored[#unstored + 1] = payload_prefix .. gid end
  end
  if #unstored > 0 then redis.call('DEL', unpack(unstored)) end
end
if n_dup > 0 then redis.call('HINCRBY', counters, 'duplicates', n_dup) end

-- 3. Evict past max_size, oldest (lowest insert sequence) first.
local n_evicted, n_unsampled = 0, 0
if size > max_size then
  local popped = redis.call('ZPOPMIN', order, size - max_size)
  local old, old_keys = {}, {}
  for i = 1, #popped, 2 do
    old[#old + 1] = popped[i]
    old_keys[#old_keys + 1] = payload_prefix .. popped[i]
  end
  variadic('DEL', nil, old_keys)
  variadic('ZREM', byver, old)
  variadic('ZREM', prio, old)
  n_evicted = #old
  n_unsampled = n_evicted - variadic('HDEL', uses, old)
  size = max_size
  redis.call('HINCRBY', counters, 'evicted:max_size', n_evicted)
  if n_unsampled > 0 then redis.call('HINCRBY', counters, 'dropped:evicted_unsampled', n_unsampled) end
end
return {statuses, size, n_evicted, n_unsampled}
