-- A consumer's leases (taken by sample.lua) and the dead-letter list, atomically. ARGV[1] is the op:
--   ack:     consumer, max_times, payload_prefix, consumer_prefix, with_priorities ('0' | '1'), then
--            lease ids... ('1': each id followed by its group's new priority, '' = unchanged)
--            each of the consumer's leases ends and its use counts (uses + 1, `acked`, `sampled`); a
--            group whose acked uses reach max_times_sampled with no lease left out leaves the buffer
--            (counted evicted:max_times_sampled). A group that stays and has a priority (inserted under
--            `prioritized`) takes the new one, indexed or held, in the same call (counted
--            `reprioritized`). Returns {acked, retired, the unknown ids...}.
--   renew:   consumer, lease_ms, consumer_prefix -> every lease of the consumer gets deadline now +
--            lease_ms. Returns the number of leases renewed.
--   release: consumer, max_times, consumer_prefix, lease ids... (none: all of the consumer's) -> the
--            leases end without an ack, their uses go back (counted `redelivered`). Returns the count.
--   dead:    consumer ('' = by group id), max_times, payload_prefix, consumer_prefix, dead_max, then 4 per
--            entry: lease id or group id, reason, field, counter field -> the group leaves the buffer
--            (payload deleted), a JSON record is pushed on the dead-letter list (trimmed to dead_max),
--            `dropped:invalid:<counter field>` counted. Returns the number of records pushed.
local op = ARGV[1]
run_even_at_maxmemory()

-- The consumer's lease ids among `ids` (others: unknown, expired or someone else's) and their values.
local function owned(consumer, ids)
  local values = multi('HMGET', K.leases, ids)
  local mine, vals, unknown, dup = {}, {}, {}, {}
  for i, id in ipairs(ids) do
    local v = values[i]
    if v and string.sub(v, 1, #consumer + 1) == consumer .. ' ' and not dup[id] then
      dup[id] = true
      mine[#mine + 1] = id
      vals[#vals + 1] = v
    elseif not dup[id] then
      unknown[#unknown + 1] = id
    end
  end
  return mine, vals, unknown
end

local function ids_from(first)
  local ids = {}
  for i = first, #ARGV do ids[#ids + 1] = ARGV[i] end
  return ids
end

-- A stored group's new priority: in the priority index when indexed, in its `held` record when held;
-- only for groups that have one. Returns 1 when it changed something.
local function reprioritize(gid, priority)
  if redis.call('ZSCORE', K.prio, gid) then
    redis.call('ZADD', K.prio, 'XX', priority, gid)
    return 1
  end
  local meta = redis.call('HGET', K.held, gid)
  if not meta then return 0 end
  local seq, pv, pr = string.match(meta, '^(%S+) (%S+) (%S+)$')
  if pr == '-' then return 0 end
  redis.call('HSET', K.held, gid, seq .. ' ' .. pv .. ' ' .. priority)
  return 1
end

if op == 'ack' then
  local consumer, max_times, payload_prefix, consumer_prefix = ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5]
  local ids, new_priority = ids_from(7), {}
  if ARGV[6] == '1' then
    local plain = {}
    for i = 1, #ids, 2 do
      plain[#plain + 1] = ids[i]
      if ids[i + 1] ~= '' then new_priority[ids[i]] = ids[i + 1] end
    end
    ids = plain
  end
  local mine, vals, unknown = owned(consumer, ids)
  local gids = forget_leases(mine, vals, consumer_prefix)
  local stored = stored_set(gids)
  local left = unlease(gids, stored)
  local retired = {}
  for _, gid in ipairs(gids) do
    if stored[gid] then
      local n = redis.call('HINCRBY', K.uses, gid, 1)
      if max_times > 0 and n >= max_times and left[gid] == 0 and stored[gid] then
        retired[#retired + 1] = gid
        stored[gid] = nil  -- retired once even when acked twice in this call
      end
    end
  end
  retire(retired, payload_prefix, false)
  local n_prio = 0
  for i, id in ipairs(mine) do
    if new_priority[id] then n_prio = n_prio + reprioritize(gids[i], new_priority[id]) end
  end
  if n_prio > 0 then redis.call('HINCRBY', K.counters, 'reprioritized', n_prio) end
  if #mine > 0 then
    redis.call('HINCRBY', K.counters, 'acked', #mine)
    redis.call('HINCRBY', K.counters, 'sampled', #mine)
  end
  if #retired > 0 then redis.call('HINCRBY', K.counters, 'evicted:max_times_sampled', #retired) end
  local out = {#mine, #retired}
  for _, id in ipairs(unknown) do out[#out + 1] = id end
  return out
end

if op == 'renew' then
  local consumer, lease_ms, consumer_prefix = ARGV[2], tonumber(ARGV[3]), ARGV[4]
  local ids = redis.call('SMEMBERS', consumer_prefix .. consumer)
  local deadline = now_ms() + lease_ms
  for i = 1, #ids, CHUNK do
    local pairs_ = {}
    for j = i, math.min(i + CHUNK - 1, #ids) do
      pairs_[#pairs_ + 1] = deadline
      pairs_[#pairs_ + 1] = ids[j]
    end
    redis.call('ZADD', K.deadlines, 'XX', unpack(pairs_))
  end
  return #ids
end

if op == 'release' then
  local consumer, max_times, consumer_prefix = ARGV[2], tonumber(ARGV[3]), ARGV[4]
  local ids = ids_from(5)
  if #ids == 0 then ids = redis.call('SMEMBERS', consumer_prefix .. consumer) end
  local mine = owned(consumer, ids)
  return return_leases(mine, max_times, consumer_prefix)
end

if op == 'dead' then
  local consumer, max_times, payload_prefix, consumer_prefix = ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5]
  local dead_max, now = tonumber(ARGV[6]), now_ms()
  local n = 0
  for i = 7, #ARGV, 4 do
    local item, reason, field, counter = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
    local gid, lease_id = item, false
    if consumer ~= '' then
      local mine, vals = owned(consumer, {item})
      if #mine == 1 then
        lease_id = item
        gid = forget_leases(mine, vals, consumer_prefix)[1]
      else
        gid = false  -- not a lease of this consumer (acked, released, expired): nothing to set aside
      end
    end
    if gid then
      retire({gid}, payload_prefix, false)
      local record = cjson.encode({group_id = gid, reason = reason, field = field, time_ms = now,
        consumer = consumer, lease_id = lease_id or ''})
      redis.call('LPUSH', K.dead, record)
      redis.call('HINCRBY', K.counters, 'dropped:invalid:' .. counter, 1)
      n = n + 1
    end
  end
  if n > 0 then redis.call('LTRIM', K.dead, 0, dead_max - 1) end
  return n
end

return redis.error_reply('lease.lua: unknown op ' .. tostring(op))
