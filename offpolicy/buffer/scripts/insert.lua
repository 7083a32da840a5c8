-- Insert a batch of groups atomically: return expired leases, dedupe, index, count, evict past max_size
-- (oldest indexed group first), keep the payload bytes within max_bytes, trim the dedupe window.
-- Runs inside the client's MULTI/EXEC, right after a `SET <payload key> <payload> NX` of every group:
-- no payload passes through Lua. A new group's payload is then already in place; NX left a stored
-- group's payload untouched, and the script DELetes the payload keys those SETs created for groups it
-- does not store (a duplicate whose original is gone, a group the ratio limiter or max_bytes refused).
-- Images go the same way: the batch's new images are SET NX at their keys before the script; a stored
-- group counts one more reference to each image it names (a new image's bytes count once), and the
-- script DELetes the image keys this transaction SET that no stored group names. A group naming an image
-- that is neither stored nor in the batch is refused (status 4), alone.
-- ARGV: max_size, use_ratio (0|1), samples_per_insert, max_diff, min_size_to_sample, use_priority (0|1),
--       payload_prefix, max_times_sampled (0 = none), consumer_prefix, dedupe_window (0 = no count bound),
--       dedupe_window_ms (0 = no age bound), max_bytes (0 = no bound), the images this transaction SET
--       ("sha sha ..."), then 5 per group: group_id, policy_version, priority, payload bytes, the distinct
--       images it names ("sha sha ...", "" none)
--       (payload keys are payload_prefix .. group_id: same hash tag, same Cluster slot)
-- Returns: {statuses (1 inserted, 0 duplicate, 2 rate limited, 3 over max_bytes, 4 an image missing),
--   size, evicted_max_size,
--   evicted_unsampled, n_expired, payload bytes stored after, evicted_max_bytes}
-- Every redis.call costs a few microseconds of its own, so the indexes are written with one variadic
-- call each (the batch is at most 1000 groups: the client splits larger ones).
local max_size = tonumber(ARGV[1])
local use_ratio = ARGV[2] == '1'
local spi = tonumber(ARGV[3])
local max_diff = tonumber(ARGV[4])
local min_size = tonumber(ARGV[5])
local use_priority = ARGV[6] == '1'
local payload_prefix = ARGV[7]
local max_times, consumer_prefix = tonumber(ARGV[8]), ARGV[9]
local window, window_ms = tonumber(ARGV[10]), tonumber(ARGV[11])
local max_bytes = tonumber(ARGV[12])
local sent_images = ARGV[13]
local FIRST, PER = 14, 5
local ROOM_SCAN = 64  -- oldest indexed groups looked at to make room for bytes

local now = now_ms()
local n_expired = expire_leases(now, max_times, consumer_prefix)

local gids = {}
for i = FIRST, #ARGV, PER do gids[#gids + 1] = ARGV[i] end
-- A duplicate: in the dedupe window, or stored (a group may outlive its window entry).
local in_window = redis.call('ZMSCORE', K.seen, unpack(gids))
local stored_now = stored_set(gids)
local c = redis.call('HMGET', K.counters, 'inserted', 'sampled')
local inserted, sampled = tonumber(c[1] or '0'), tonumber(c[2] or '0') + redis.call('HLEN', K.leases)
local size = redis.call('ZCARD', K.order) + redis.call('HLEN', K.held)
local bytes = tonumber(redis.call('HGET', K.counters, 'bytes') or '0')
local n_room = 0  -- groups evicted to make room for bytes

-- Evict the oldest indexed groups already sampled at least once (among the ROOM_SCAN oldest) until `need`
-- bytes are free; a group nobody has used is never evicted for bytes. True when that made the room (only
-- then is anything evicted). With max_times 1 an indexed group has no uses: nothing to evict.
local function make_room(need)
  if max_times == 1 then return false end
  local oldest = redis.call('ZRANGE', K.order, 0, ROOM_SCAN - 1)
  if #oldest == 0 then return false end
  local used, sizes = multi('HMGET', K.uses, oldest), multi('HMGET', K.sizes, oldest)
  local victims, freed = {}, 0
  for i, gid in ipairs(oldest) do
    if freed >= need then break end
    if used[i] then
      victims[#victims + 1] = gid
      freed = freed + tonumber(sizes[i] or '0')
    end
  end
  if freed < need then return false end
  retire(victims, payload_prefix, false)
  bytes, size, n_room = bytes - freed, size - #victims, n_room + #victims
  return true
end
-- Dedupe window scores: insert time in ms, strictly increasing (+1/1024 ms per id), so the window is
-- trimmed in insert order even within one batch or one millisecond.
local STEP = 1 / 1024
local stamp = now
local newest = redis.call('ZREVRANGE', K.seen, 0, 0, 'WITHSCORES')[2]
if newest and tonumber(newest) >= stamp then stamp = tonumber(newest) + STEP end

-- A group's images, pinned (one reference more each, so that making room for its bytes never deletes
-- them): the bytes of the images no stored group named before (their keys hold this transaction's SET,
-- or an image retired moments ago that a consumer may still read), and false when one is missing
-- (nothing pinned then).
local function pin_images(shas)
  local fresh = 0
  for i, sha in ipairs(shas) do
    local n = redis.call('HINCRBY', K.images, sha, 1)
    if n == 1 then
      local size = redis.call('STRLEN', image_key(sha))
      if size == 0 then
        for m = 1, i do
          if redis.call('HINCRBY', K.images, shas[m], -1) <= 0 then redis.call('HDEL', K.images, shas[m]) end
        end
        return false
      end
      fresh = fresh + size
    end
  end
  return fresh
end

local function unpin_images(shas)
  for _, sha in ipairs(shas) do
    if redis.call('HINCRBY', K.images, sha, -1) <= 0 then redis.call('HDEL', K.images, sha) end
  end
end

-- 1. Decide each group in batch order: duplicate, refused by the ratio limiter or max_bytes (and all
-- after it), an image missing (that group alone), new.
local statuses, new, others, taken = {}, {}, {}, {}
local by_order, by_version, by_priority, by_time = {}, {}, {}, {}
local by_size, added, by_images, image_added, images_added = {}, 0, {}, 0, 0
local n_dup, n_missing, refused = 0, 0, nil  -- refused: the status of every group after a refusal (2 or 3)
for j, gid in ipairs(gids) do
  local status = 1
  local a = FIRST + PER * (j - 1)
  local nb = tonumber(ARGV[a + 3])
  local shas, fresh = {}, 0
  for sha in string.gmatch(ARGV[a + 4], '%S+') do shas[#shas + 1] = sha end
  if refused then
    status = refused
  elseif in_window[j] or stored_now[gid] or taken[gid] then
    status = 0
    n_dup = n_dup + 1
  else
    if #shas > 0 then
      fresh = pin_images(shas)
      if not fresh then
        status, fresh = 4, 0
        n_missing = n_missing + 1
      end
    end
    local need = nb + fresh
    if status ~= 1 then
      -- an image missing: this group alone is refused
    elseif use_ratio and math.min(size, max_size) + 1 > min_size and (inserted + 1) * spi - sampled > max_diff then
      -- Reverb's SampleToInsertRatio: inserts may run ahead of uses (acked + leased) by at most max_diff.
      refused, status = 2, 2
    elseif max_bytes > 0 and bytes > 0 and bytes + need > max_bytes and not make_room(bytes + need - max_bytes) then
      -- Over the byte budget (an empty buffer takes any one group, so none is refused for good).
      refused, status = 3, 3
    end
    if status ~= 1 and status ~= 4 and #shas > 0 then unpin_images(shas) end
  end
  statuses[j] = status
  if status == 1 then
    taken[gid] = true
    inserted = inserted + 1
    size = size + 1
    bytes = bytes + nb + fresh
    added = added + nb + fresh
    by_size[#by_size + 1] = gid
    by_size[#by_size + 1] = nb
    if #shas > 0 then
      by_images[#by_images + 1] = gid
      by_images[#by_images + 1] = ARGV[a + 4]
      if fresh > 0 then
        image_added = image_added + fresh
        for _, sha in ipairs(shas) do
          if redis.call('HGET', K.images, sha) == '1' then
            redis.call('PERSIST', image_key(sha))  -- an image retired moments ago (a grace expiry) is back
            images_added = images_added + 1
          end
        end
      end
    end
    new[#new + 1] = gid
    by_order[#by_order + 1] = inserted
    by_order[#by_order + 1] = gid
    by_version[#by_version + 1] = ARGV[a + 1]
    by_version[#by_version + 1] = gid
    by_priority[#by_priority + 1] = ARGV[a + 2]
    by_priority[#by_priority + 1] = gid
    by_time[#by_time + 1] = stamp
    by_time[#by_time + 1] = gid
    stamp = stamp + STEP
  elseif not taken[gid] then
    -- Not stored by this batch (a duplicate, or refused): its payload key holds this transaction's SET
    -- unless the group is stored already (NX kept the stored payload), refused or not.
    others[#others + 1] = gid
  end
end

-- 2. Index the new groups; delete the payload keys of groups not stored.
if #new > 0 then
  redis.call('ZADD', K.seen, unpack(by_time))
  redis.call('ZADD', K.order, unpack(by_order))
  redis.call('ZADD', K.byver, unpack(by_version))
  if use_priority then redis.call('ZADD', K.prio, unpack(by_priority)) end
  redis.call('HSET', K.counters, 'inserted', inserted)
  redis.call('HSET', K.sizes, unpack(by_size))
  redis.call('HINCRBY', K.counters, 'bytes', added)
end
if #by_images > 0 then variadic('HSET', K.gimages, by_images) end
if image_added > 0 then redis.call('HINCRBY', K.counters, 'image_bytes', image_added) end
if images_added > 0 then redis.call('HINCRBY', K.counters, 'images', images_added) end
if n_missing > 0 then redis.call('HINCRBY', K.counters, 'rejected:images', n_missing) end
-- The images this transaction SET that no stored group names (their groups refused or duplicates); one
-- whose key was there before (NX kept it: retired moments ago, expiring) is left to expire.
local unnamed = {}
for sha in string.gmatch(sent_images, '%S+') do
  if not redis.call('HGET', K.images, sha) and redis.call('PTTL', image_key(sha)) == -1 then
    unnamed[#unnamed + 1] = image_key(sha)
  end
end
if #unnamed > 0 then variadic('DEL', nil, unnamed) end
if n_room > 0 then redis.call('HINCRBY', K.counters, 'evicted:max_bytes', n_room) end
local unstored = {}
for _, gid in ipairs(others) do
  if not stored_now[gid] then unstored[#unstored + 1] = payload_prefix .. gid end
end
if #unstored > 0 then redis.call('DEL', unpack(unstored)) end
if n_dup > 0 then redis.call('HINCRBY', K.counters, 'duplicates', n_dup) end

-- 3. Evict past max_size, oldest indexed (lowest insert sequence) first; held groups (leased to their
-- last use) are not evicted: the buffer can hold more than max_size while they are out.
local n_evicted, n_unsampled = 0, 0
if size > max_size then
  local popped = redis.call('ZPOPMIN', K.order, size - max_size)
  local old = {}
  for i = 1, #popped, 2 do old[#old + 1] = popped[i] end
  local used, leased = multi('HMGET', K.uses, old), multi('HMGET', K.leased, old)
  for i = 1, #old do
    if not used[i] and not leased[i] then n_unsampled = n_unsampled + 1 end
  end
  retire(old, payload_prefix, false)
  n_evicted = #old
  size = size - n_evicted
  redis.call('HINCRBY', K.counters, 'evicted:max_size', n_evicted)
  if n_unsampled > 0 then redis.call('HINCRBY', K.counters, 'dropped:evicted_unsampled', n_unsampled) end
end

-- 4. Trim the dedupe window (oldest entries first, at most CHUNK per call: a count window keeps up,
-- since a call adds at most CHUNK; an age window's backlog drains by CHUNK per insert call).
local excess = 0
if window > 0 then excess = redis.call('ZCARD', K.seen) - window end
if window_ms > 0 then
  excess = math.max(excess, redis.call('ZCOUNT', K.seen, '-inf', '(' .. (now - window_ms)))
end
if excess > 0 then redis.call('ZREMRANGEBYRANK', K.seen, 0, math.min(excess, CHUNK) - 1) end
bytes = tonumber(redis.call('HGET', K.counters, 'bytes') or '0')  -- after any eviction
return {statuses, size, n_evicted, n_unsampled, n_expired, bytes, n_room}
