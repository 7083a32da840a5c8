-- Shared by insert.lua, sample.lua and lease.lua (buffer/storage.py puts this text in front of each):
-- the index keys, variadic calls, and the group and lease life cycle.
-- KEYS: order by_version uses priority seen counters leases deadlines leased held dead sizes images
--       group_images
--       (all under one {run_id} hash tag; buffer/keys.py `BufferKeys.indexes`)
-- A stored group is either *indexed* (in order, by_version and, for `prioritized`, priority: a sampler
-- may choose it) or *held* (acked uses + outstanding leases reached max_times_sampled: out of the
-- sampler indexes, its "seq pv priority" kept in `held` until an ack retires it or a release returns it).
-- Invariant: indexed iff uses[gid] + leased[gid] < max_times (max_times 0 = no limit: never held).
-- Bytes: `sizes` holds each stored group's payload length (set by insert.lua), counters `bytes` their sum;
-- every removal goes through `retire`, which takes them off (a lease or its end changes neither).
-- Images: each stored once, at `images .. ':' .. sha256`, whatever number of groups name it; `images` counts
-- the stored groups naming each, `group_images` lists each group's ("sha sha ..."). An image's bytes count
-- in `bytes` (and `image_bytes`) while a stored group names it; `retire` deletes it with the last of them.
local K = {
  order = KEYS[1], byver = KEYS[2], uses = KEYS[3], prio = KEYS[4], seen = KEYS[5], counters = KEYS[6],
  leases = KEYS[7], deadlines = KEYS[8], leased = KEYS[9], held = KEYS[10], dead = KEYS[11],
  sizes = KEYS[12], images = KEYS[13], gimages = KEYS[14],
}
local CHUNK = 1000  -- unpack has a stack limit; every variadic call takes at most this many members

-- Run `cmd key members...` in chunks; returns the sum of the (integer) replies.
local function variadic(cmd, key, members)
  local n = 0
  for i = 1, #members, CHUNK do
    local last = math.min(i + CHUNK - 1, #members)
    if key then
      n = n + redis.call(cmd, key, unpack(members, i, last))
    else
      n = n + redis.call(cmd, unpack(members, i, last))
    end
  end
  return n
end

-- Run `cmd key members...` in chunks; returns the concatenated list replies (HMGET, ZMSCORE).
local function multi(cmd, key, members)
  local out = {}
  for i = 1, #members, CHUNK do
    local part = redis.call(cmd, key, unpack(members, i, math.min(i + CHUNK - 1, #members)))
    for j = 1, #part do out[i + j - 1] = part[j] end  -- a missing field is false, not nil
  end
  return out
end

-- The consumer's scripts (sample.lua, lease.lua) free memory, so they must run when Redis is past its
-- maxmemory. Redis refuses a script's first memory-growing (denyoom) command then, but never one after the
-- script has written (it cannot stop a script in the middle): they start with a write that grows nothing
-- (HDEL of a field that never exists). insert.lua does not: a producer at maxmemory is refused (BufferFull).
local function run_even_at_maxmemory()
  redis.call('HDEL', K.counters, '-')
end

-- Redis' clock in milliseconds (lease deadlines, dedupe ages, dead-letter times).
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Take groups out of the sampler indexes (not out of `held`).
local function unindex(gids)
  if #gids == 0 then return end
  variadic('ZREM', K.order, gids)
  variadic('ZREM', K.byver, gids)
  variadic('ZREM', K.prio, gids)
end

-- The key of the image whose sha256 is `sha`.
local function image_key(sha)
  return K.images .. ':' .. sha
end

-- The groups `gids` no longer name their images: an image no stored group names any more leaves the
-- buffer (its key deleted; with `grace_ms`, expiring that much later instead, so that the consumer that
-- just took the last group naming it can still read it). Returns the image bytes freed.
local function drop_images(gids, grace_ms)
  local lists, names, freed, n_freed = multi('HMGET', K.gimages, gids), {}, 0, 0
  for i, gid in ipairs(gids) do
    if lists[i] then
      names[#names + 1] = gid
      for sha in string.gmatch(lists[i], '%S+') do
        if redis.call('HINCRBY', K.images, sha, -1) <= 0 then
          redis.call('HDEL', K.images, sha)
          local key = image_key(sha)
          freed, n_freed = freed + redis.call('STRLEN', key), n_freed + 1
          if grace_ms and grace_ms > 0 then
            redis.call('PEXPIRE', key, grace_ms)
          else
            redis.call('DEL', key)
          end
        end
      end
    end
  end
  if #names == 0 then return 0 end
  variadic('HDEL', K.gimages, names)
  if freed > 0 then redis.call('HINCRBY', K.counters, 'image_bytes', -freed) end
  if n_freed > 0 then redis.call('HINCRBY', K.counters, 'images', -n_freed) end
  return freed
end

-- Remove groups from the buffer: indexes, held, use and lease counts, the images only they name; their
-- payload keys too unless the caller moves them itself (keep_payload; `grace_ms`: see `drop_images`).
-- Leases still naming them stay until acked or released.
local function retire(gids, payload_prefix, keep_payload, grace_ms)
  if #gids == 0 then return end
  local sizes, freed = multi('HMGET', K.sizes, gids), 0
  for i = 1, #gids do freed = freed + tonumber(sizes[i] or '0') end
  freed = freed + drop_images(gids, grace_ms)
  if freed > 0 then
    variadic('HDEL', K.sizes, gids)
    redis.call('HINCRBY', K.counters, 'bytes', -freed)
  end
  unindex(gids)
  variadic('HDEL', K.held, gids)
  variadic('HDEL', K.uses, gids)
  variadic('HDEL', K.leased, gids)
  if not keep_payload then
    local names = {}
    for i, gid in ipairs(gids) do names[i] = payload_prefix .. gid end
    variadic('DEL', nil, names)
  end
end

-- Move indexed groups to `held`, remembering what re-indexing needs: "seq pv priority" ("-": none).
local function hold(gids)
  if #gids == 0 then return end
  local seqs, pvs, prs = multi('ZMSCORE', K.order, gids), multi('ZMSCORE', K.byver, gids),
    multi('ZMSCORE', K.prio, gids)
  local pairs_ = {}
  for i, gid in ipairs(gids) do
    pairs_[#pairs_ + 1] = gid
    pairs_[#pairs_ + 1] = seqs[i] .. ' ' .. pvs[i] .. ' ' .. (prs[i] or '-')
  end
  variadic('HSET', K.held, pairs_)
  unindex(gids)
end

-- Return held groups to the sampler indexes (a released or expired lease made them sampleable again).
local function unhold(gids)
  if #gids == 0 then return end
  local metas = multi('HMGET', K.held, gids)
  local by_order, by_version, by_priority = {}, {}, {}
  for i, gid in ipairs(gids) do
    local seq, pv, pr = string.match(metas[i], '^(%S+) (%S+) (%S+)$')
    by_order[#by_order + 1] = seq
    by_order[#by_order + 1] = gid
    by_version[#by_version + 1] = pv
    by_version[#by_version + 1] = gid
    if pr ~= '-' then
      by_priority[#by_priority + 1] = pr
      by_priority[#by_priority + 1] = gid
    end
  end
  variadic('ZADD', K.order, by_order)
  variadic('ZADD', K.byver, by_version)
  variadic('ZADD', K.prio, by_priority)
  variadic('HDEL', K.held, gids)
end

-- Which of `gids` are stored (indexed or held): a table gid -> true.
local function stored_set(gids)
  local out = {}
  if #gids == 0 then return out end
  local indexed, held = multi('ZMSCORE', K.order, gids), multi('HMGET', K.held, gids)
  for i, gid in ipairs(gids) do
    if indexed[i] or held[i] then out[gid] = true end
  end
  return out
end

-- Forget lease records: `ids` with their "consumer gid" values; returns the gids, one per lease.
local function forget_leases(ids, values, consumer_prefix)
  local gids, by_consumer = {}, {}
  for i, id in ipairs(ids) do
    local consumer, gid = string.match(values[i], '^(%S+) (.+)$')
    gids[i] = gid
    by_consumer[consumer] = by_consumer[consumer] or {}
    table.insert(by_consumer[consumer], id)
  end
  variadic('HDEL', K.leases, ids)
  variadic('ZREM', K.deadlines, ids)
  for consumer, mine in pairs(by_consumer) do variadic('SREM', consumer_prefix .. consumer, mine) end
  return gids
end

-- One outstanding lease fewer on each of `gids` (one entry per lease) of stored groups; returns the
-- groups whose outstanding count changed, with their new counts (a table gid -> n).
local function unlease(gids, stored)
  local left = {}
  for _, gid in ipairs(gids) do
    if stored[gid] then
      local n = redis.call('HINCRBY', K.leased, gid, -1)
      if n <= 0 then redis.call('HDEL', K.leased, gid) end
      left[gid] = math.max(n, 0)
    end
  end
  return left
end

-- End leases without an ack (release, expiry): each use goes back to its group, if it is still stored
-- (a held group becomes sampleable again); counted `redelivered`. Returns the number of leases ended.
local function return_leases(ids, max_times, consumer_prefix)
  if #ids == 0 then return 0 end
  local values = multi('HMGET', K.leases, ids)
  local live = {}
  local live_values = {}
  for i, id in ipairs(ids) do
    if values[i] then
      live[#live + 1] = id
      live_values[#live_values + 1] = values[i]
    end
  end
  if #live == 0 then return 0 end
  local gids = forget_leases(live, live_values, consumer_prefix)
  local uniq, seen_gid = {}, {}
  for _, gid in ipairs(gids) do
    if not seen_gid[gid] then
      seen_gid[gid] = true
      uniq[#uniq + 1] = gid
    end
  end
  local stored = stored_set(uniq)
  local left = unlease(gids, stored)
  if max_times > 0 then
    local candidates = {}
    for gid, _ in pairs(left) do candidates[#candidates + 1] = gid end
    local held_meta = multi('HMGET', K.held, candidates)
    local used = multi('HMGET', K.uses, candidates)
    local back = {}
    for i, gid in ipairs(candidates) do
      if held_meta[i] and tonumber(used[i] or '0') + left[gid] < max_times then back[#back + 1] = gid end
    end
    unhold(back)
  end
  redis.call('HINCRBY', K.counters, 'redelivered', #live)
  return #live
end

-- Leases past their deadline go back to the buffer, at most CHUNK per call (lazily: every insert and
-- sample runs this first). Returns the number expired.
local function expire_leases(now, max_times, consumer_prefix)
  local ids = redis.call('ZRANGEBYSCORE', K.deadlines, '-inf', now, 'LIMIT', 0, CHUNK)
  return return_leases(ids, max_times, consumer_prefix)
end
