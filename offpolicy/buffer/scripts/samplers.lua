-- The samplers (put in front of sample.lua by buffer/storage.py; the rules: buffer/samplers.py).
-- Each chooses k distinct indexed groups in O(k log N) (expected, for the weighted ones) with rank
-- reads of the sorted sets (ZRANGE i i: O(log N)); none reads or sorts the whole index.

-- Floyd's algorithm: k distinct ranks out of `size`, each subset equally likely.
local function uniform(k, size)
  local chosen, picked = {}, {}
  for j = size - k + 1, size do
    local t = math.random(1, j)
    if picked[t] then t = j end
    picked[t] = true
    chosen[#chosen + 1] = redis.call('ZRANGE', K.order, t - 1, t - 1)[1]
  end
  return chosen
end

-- Weighted sampling without replacement, exact (successive sampling: each pick has probability
-- weight / total weight of the groups not picked yet). `bands` split the sorted set `key` into score
-- intervals covering (-inf, +inf) in ascending order, each with `m`, an upper bound of the weights in
-- it no more than 2x the smallest one there (0 for a band of zero weights). A pick proposes a band with
-- probability left_j * m_j / sum(left * m), a uniform not-yet-picked rank in it (a sparse Fisher-Yates
-- swap table per band: no duplicates, no retries for them), reads that one member (ZRANGE, O(log N))
-- and accepts it with probability weight / m_j (>= 1/2), else proposes again. The accepted pick has
-- probability left_j m_j / M * 1 / left_j * w / m_j = w / M per proposal: exactly proportional to w.
-- When only zero-weight groups are left, they are picked uniformly (as Efraimidis-Spirakis' -inf keys).
local function banded(key, bands, weight, k)
  local start, mass = 0, 0
  for _, b in ipairs(bands) do
    b.start = start
    b.left = redis.call('ZCOUNT', key, b.lo, b.hi)
    b.swap = {}
    start = start + b.left
    mass = mass + b.left * b.m
  end
  local chosen, attempts = {}, 0
  while #chosen < k do
    attempts = attempts + 1
    if attempts > 1000 + 100 * k then error('sampler: too many rejections') end
    local uniform_pick = mass <= 1e-300  -- only zero-weight groups left
    local x, b = math.random(), nil
    local total = 0
    for _, c in ipairs(bands) do total = total + c.left * (uniform_pick and 1 or c.m) end
    x = x * total
    for _, c in ipairs(bands) do
      if c.left > 0 then
        b = c
        x = x - c.left * (uniform_pick and 1 or c.m)
        if x < 0 then break end
      end
    end
    local r = math.random(1, b.left)
    local pos = b.swap[r] or r
    local row = redis.call('ZRANGE', key, b.start + pos - 1, b.start + pos - 1, 'WITHSCORES')
    if uniform_pick or math.random() * b.m < weight(tonumber(row[2])) then
      chosen[#chosen + 1] = row[1]
      b.swap[r] = b.swap[b.left] or b.left
      b.left = b.left - 1
      mass = 0
      for _, c in ipairs(bands) do mass = mass + c.left * c.m end
    end
  end
  return chosen
end

-- staleness_weighted: weight 1 / (max(cv - pv, 0) + 1). Band 0: pv >= cv (weight 1); band j >= 1:
-- staleness in [2^(j-1), 2^j - 1] (weights within 2x of each other); the oldest band reaches -inf.
local function staleness_bands(cv)
  local oldest = tonumber(redis.call('ZRANGE', K.byver, 0, 0, 'WITHSCORES')[2])
  local bands = {{lo = tostring(cv), hi = '+inf', m = 1}}
  local j = 1
  while oldest < cv - 2 ^ (j - 1) + 1 do
    table.insert(bands, 1, {lo = tostring(cv - 2 ^ j + 1), hi = tostring(cv - 2 ^ (j - 1)), m = 1 / (2 ^ (j - 1) + 1)})
    j = j + 1
  end
  bands[1].lo = '-inf'
  return bands
end

-- prioritized: weight (priority + eps)^alpha (alpha 0: every weight 1, uniform). Band b: weight in
-- [2^b, 2^(b+1)), i.e. priority in [2^(b/alpha) - eps, 2^((b+1)/alpha) - eps); at most 64 bands (the
-- lowest reaches down to -inf, or to 0 exclusive when eps = 0, where the priority-0 groups form a band
-- of weight 0).
local function priority_bands(eps, alpha)
  if alpha == 0 then return {{lo = '-inf', hi = '+inf', m = 1}} end
  local function fmt(x) return string.format('%.17g', x) end
  local function log2w(u) return alpha * math.log(u) / math.log(2) end  -- log2 of the weight of u = p + eps
  local function edge(b) return fmt(2 ^ (b / alpha) - eps) end  -- the priority where weight 2^b starts
  local bands = {}
  local low = '-inf'
  local first = redis.call('ZRANGE', K.prio, 0, 0, 'WITHSCORES')
  local top = tonumber(redis.call('ZRANGE', K.prio, -1, -1, 'WITHSCORES')[2])
  local lowest = tonumber(first[2]) + eps
  if lowest <= 0 then
    bands[1] = {lo = '-inf', hi = '0', m = 0}
    low = '(0'
    local pos = redis.call('ZRANGEBYSCORE', K.prio, '(0', '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
    if #pos == 0 then return bands end
    lowest = tonumber(pos[2]) + eps
  end
  local bmax = math.floor(log2w(top + eps))
  local bmin = math.max(math.floor(log2w(lowest)), bmax - 63)
  for b = bmin, bmax do
    local hi = '(' .. edge(b + 1)
    if b == bmax then hi = '+inf' end
    bands[#bands + 1] = {lo = low, hi = hi, m = math.max(2 ^ (b + 1), (top + eps) ^ alpha)}
    if b < bmax then bands[#bands].m = 2 ^ (b + 1) end
    low = edge(b + 1)
  end
  return bands
end

local function choose(sampler, k, size, cv, eps, alpha)
  if sampler == 'fifo' then return redis.call('ZRANGE', K.order, 0, k - 1) end
  if sampler == 'newest' then return redis.call('ZREVRANGE', K.order, 0, k - 1) end
  if sampler == 'uniform' then return uniform(k, size) end
  if sampler == 'staleness_weighted' then
    return banded(K.byver, staleness_bands(cv), function(pv) return 1 / (math.max(cv - pv, 0) + 1) end, k)
  end
  return banded(K.prio, priority_bands(eps, alpha), function(p) return math.max(p + eps, 0) ^ alpha end, k)
end
