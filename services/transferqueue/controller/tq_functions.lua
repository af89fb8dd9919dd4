#!lua name=sluice_tq
--[[
TransferQueue metadata, kept entirely in Redis and changed only by these functions, so every
operation is atomic and several controller replicas (or a restarted one) see one truth.

Key layout (K = key prefix, P = partition, T = task, row/group indices are decimal):
  K:partitions          ZSET  P -> created ms
  K:tasks               HASH  T -> {"fields":[...],"group_size":n}  (T = "<scope>/..." applies only to
                              partitions P = "<scope>/...", e.g. one run's; an unscoped T to every P)
  K:shards              HASH  shard id -> address;  K:shard_ttl ZSET shard id -> expiry ms
  K:p:P                 HASH  gs, block, alloc, rows, sealed, created, shards
  K:p:P:schema          HASH  field -> canonical schema json (fixed by the first commit)
  K:p:P:f:<field>       BITMAP row has the field produced;  K:p:P:any BITMAP row has any field
  K:p:P:fcount          HASH  field -> produced rows
  K:p:P:nready|consumed|leased  HASH T -> rows
  K:p:P:t:T:rdy         BITMAP row ready for T (all required fields produced)
  K:p:P:t:T:gcnt        HASH  group -> ready rows of a not yet complete group (group size > 1)
  K:p:P:t:T:q           ZSET  claimable groups (score = group index, so claims go in row order)
  K:p:P:t:T:done        BITMAP row acked by T
  K:p:P:t:T:leases      ZSET  lease id -> expiry ms (live leases only)
  K:p:P:t:T:key:<k>     STRING claim key -> lease id (shared claims of data-parallel ranks)
  K:lease:<id>          HASH  p, t, gs, groups (csv), expiry, state (live|acked|released|expired|reset)
  K:lease:<id>:pend     HASH  group -> 1 for groups not yet acked
  K:shard_inc           HASH  shard id -> incarnation (the identity of the data it holds)
  K:shard_sweep         HASH  shard id -> incarnation whose lost rows are still to be marked
  K:p:P:lost            BITMAP row was lost (its shard came back without it); pk field 'lost' counts them
  K:p:P:t:T:lost        BITMAP row was lost before T consumed it;  K:p:P:tlost HASH T -> those rows
Errors are raised as "<GRPC_CODE> <message>".
]]

local function fail(code, msg)
  error({err = code .. ' ' .. msg})
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function istr(n) return string.format('%d', n) end

local function pkey(K, P) return K .. ':p:' .. P end
local function tkey(K, P, T) return K .. ':p:' .. P .. ':t:' .. T end

local function need_partition(K, P)
  local pk = pkey(K, P)
  if redis.call('EXISTS', pk) == 0 then fail('NOT_FOUND', 'partition ' .. P .. ' does not exist') end
  return pk
end

-- A task named "<scope>/..." (a run's) applies only to partitions named "<scope>/..."; an unscoped task to all.
local function applies(P, T)
  local slash = string.find(T, '/', 1, true)
  if not slash then return true end
  return string.sub(P, 1, slash) == string.sub(T, 1, slash)
end

local function need_task(K, T, P)
  local def = redis.call('HGET', K .. ':tasks', T)
  if not def then fail('NOT_FOUND', 'task ' .. T .. ' is not registered') end
  if P and not applies(P, T) then
    fail('INVALID_ARGUMENT', 'task ' .. T .. ' is scoped to partitions ' .. string.match(T, '^[^/]*/') ..
         '...; ' .. P .. ' is not one')
  end
  local d = cjson.decode(def)
  return d.fields, tonumber(d.group_size)
end

local function need_lease(K, id)
  local lk = K .. ':lease:' .. id
  if redis.call('EXISTS', lk) == 0 then
    fail('NOT_FOUND', 'lease ' .. id .. ' is unknown (never issued, or its partition was cleared)')
  end
  return lk, redis.call('HGET', lk, 'state')
end

local function notify(K, P) redis.call('PUBLISH', K .. ':events', P) end

local function split_csv(s)
  local out = {}
  for x in string.gmatch(s or '', '[^,]+') do out[#out + 1] = tonumber(x) end
  return out
end

-- Bulk bit access: one BITFIELD call per 256 rows instead of a SETBIT/GETBIT per row.
local CHUNK = 256

local function bits(key, rows, op)
  local out = {}
  for i = 1, #rows, CHUNK do
    local args = {key}
    for j = i, math.min(i + CHUNK - 1, #rows) do
      if op == 'SET' then
        args[#args + 1] = 'SET'; args[#args + 1] = 'u1'; args[#args + 1] = rows[j]; args[#args + 1] = 1
      else
        args[#args + 1] = 'GET'; args[#args + 1] = 'u1'; args[#args + 1] = rows[j]
      end
    end
    local res = redis.call('BITFIELD', unpack(args))
    for k = 1, #res do out[#out + 1] = res[k] end
  end
  return out
end

-- rows = a, a+1, ..., b (the usual case: puts allocate ranges, claims pop them in order)?
local function as_range(rows)
  local n = #rows
  if n > 1 and rows[n] - rows[1] == n - 1 then
    for i = 2, n do if rows[i] ~= rows[i - 1] + 1 then return nil end end
    return rows[1], rows[n]
  end
  return nil
end

-- Set bits a..b with one BITFIELD op per 48 bits (exact as doubles, unlike 63-bit values).
local function set_range(key, a, b)
  local args = {}
  local off = a
  while off <= b do
    local w = math.min(48, b - off + 1)
    args[#args + 1] = 'SET'; args[#args + 1] = 'u' .. w; args[#args + 1] = off
    args[#args + 1] = string.format('%d', 2 ^ w - 1)
    off = off + w
    if #args >= 4 * CHUNK then redis.call('BITFIELD', key, unpack(args)); args = {} end
  end
  if #args > 0 then redis.call('BITFIELD', key, unpack(args)) end
end

-- How many of rows a..b have their bit set.
local function count_range(key, a, b)
  return redis.call('BITCOUNT', key, a, b, 'BIT')
end

-- Set rows' bits; return the rows whose bit was 0 before.
local function set_new(key, rows)
  local a, b = as_range(rows)
  if a then
    local before = count_range(key, a, b)
    if before == 0 then set_range(key, a, b); return rows end
    if before == #rows then return {} end
  end
  local old = bits(key, rows, 'SET')
  local fresh = {}
  for i, r in ipairs(rows) do if old[i] == 0 then fresh[#fresh + 1] = r end end
  return fresh
end

-- Bits of rows, as 0/1 per row.
local function get_bits(key, rows)
  local a, b = as_range(rows)
  if a then
    local set = count_range(key, a, b)
    if set == 0 or set == #rows then
      local v, out = (set == 0) and 0 or 1, {}
      for i = 1, #rows do out[i] = v end
      return out
    end
  end
  return bits(key, rows, 'GET')
end

-- ZADD members (their own score) in chunks.
local function zadd_all(key, members)
  for i = 1, #members, CHUNK do
    local args = {}
    for j = i, math.min(i + CHUNK - 1, #members) do
      args[#args + 1] = members[j]; args[#args + 1] = istr(members[j])
    end
    redis.call('ZADD', key, unpack(args))
  end
end

-- Rows just found to have all of T's fields: mark them ready and queue whole, unconsumed groups.
local function mark_ready(K, P, T, gs, rows)
  local tk = tkey(K, P, T)
  local fresh = set_new(tk .. ':rdy', rows)
  if #fresh == 0 then return end
  redis.call('HINCRBY', pkey(K, P) .. ':nready', T, #fresh)
  local queue = {}
  if gs == 1 then
    local done = get_bits(tk .. ':done', fresh)
    for i, r in ipairs(fresh) do if done[i] == 0 then queue[#queue + 1] = r end end
  else
    local counts, order = {}, {}
    for _, r in ipairs(fresh) do
      local g = math.floor(r / gs)
      if counts[g] == nil then counts[g] = 0; order[#order + 1] = g end
      counts[g] = counts[g] + 1
    end
    for _, g in ipairs(order) do
      local c = redis.call('HINCRBY', tk .. ':gcnt', istr(g), counts[g])
      if c >= gs then
        redis.call('HDEL', tk .. ':gcnt', istr(g))
        if redis.call('GETBIT', tk .. ':done', g * gs) == 0 then queue[#queue + 1] = g end
      end
    end
  end
  if #queue > 0 then zadd_all(tk .. ':q', queue) end
end

-- The subset of rows that have every one of `fields` (skipping fields known to be set).
local function rows_with_fields(pk, fields, rows, known)
  local ok = {}
  for i = 1, #rows do ok[i] = true end
  for _, f in ipairs(fields) do
    if not (known and known[f]) then
      local have = get_bits(pk .. ':f:' .. f, rows)
      for i = 1, #rows do if have[i] == 0 then ok[i] = false end end
    end
  end
  local out = {}
  for i, r in ipairs(rows) do if ok[i] then out[#out + 1] = r end end
  return out
end

-- Recompute T's readiness over every allocated row of P (task registered late, or reset; T has no state in P).
local function init_task_partition(K, P, T, fields, gs)
  local pk = pkey(K, P)
  local lost = tonumber(redis.call('HGET', pk, 'lost') or '0')
  if lost > 0 then  -- lost rows are never handed out: done and counted consumed from the start
    local tk = tkey(K, P, T)
    redis.call('BITOP', 'OR', tk .. ':done', tk .. ':done', pk .. ':lost')
    redis.call('HINCRBY', pk .. ':consumed', T, lost)
  end
  local alloc = tonumber(redis.call('HGET', pk, 'alloc') or '0')
  for start = 0, alloc - 1, 4096 do
    local rows = {}
    for r = start, math.min(start + 4095, alloc - 1) do rows[#rows + 1] = r end
    mark_ready(K, P, T, gs, rows_with_fields(pk, fields, rows, nil))
  end
end

-- Groups `names` of T lost before T consumed them: done for T (counted consumed and lost) and recorded in
-- T's lost bitmap, which LostRows reads.
local function lose_groups(K, P, T, tgs, names)
  local rows = {}
  for _, g in ipairs(names) do
    for r = tonumber(g) * tgs, tonumber(g) * tgs + tgs - 1 do rows[#rows + 1] = r end
  end
  local tk, pk = tkey(K, P, T), pkey(K, P)
  set_new(tk .. ':done', rows)
  set_new(tk .. ':lost', rows)
  redis.call('HINCRBY', pk .. ':consumed', T, #rows)
  redis.call('HINCRBY', pk .. ':tlost', T, #rows)
end

-- A lease given back (released, expired): its pending groups return to T's queue, except those lost while
-- it held them, which are lost now (the holder did not consume them) and unseal the partition for their
-- replacements.
local function requeue_lease(K, id, new_state, tk_hint)
  local lk = K .. ':lease:' .. id
  local P = redis.call('HGET', lk, 'p')
  local T = redis.call('HGET', lk, 't')
  if not P or not T then
    -- a lease id without its hash (never expected): drop it so it cannot be reaped over and over
    if tk_hint then redis.call('ZREM', tk_hint .. ':leases', id) end
    return 0
  end
  local gs = tonumber(redis.call('HGET', lk, 'gs'))
  local tk, pk = tkey(K, P, T), pkey(K, P)
  local pend = redis.call('HKEYS', lk .. ':pend')
  local lost_under = {}
  for _, g in ipairs(redis.call('HKEYS', lk .. ':lostg')) do lost_under[g] = true end
  local back, gone = {}, {}
  for _, g in ipairs(pend) do
    if lost_under[g] then gone[#gone + 1] = g else back[#back + 1] = tonumber(g) end
  end
  if #back > 0 then zadd_all(tk .. ':q', back) end
  if #pend > 0 then redis.call('HINCRBY', pk .. ':leased', T, -(#pend * gs)) end
  if #gone > 0 then
    lose_groups(K, P, T, gs, gone)
    redis.call('HSET', pk, 'sealed', 0)
  end
  redis.call('DEL', lk .. ':pend', lk .. ':lostg')
  redis.call('ZREM', tk .. ':leases', id)
  redis.call('HSET', lk, 'state', new_state)
  redis.call('PEXPIRE', lk, 3600000)
  return #back * gs
end

local function reap(K, P, T, now)
  local expired = redis.call('ZRANGEBYSCORE', tkey(K, P, T) .. ':leases', '-inf', now)
  for _, id in ipairs(expired) do requeue_lease(K, id, 'expired', tkey(K, P, T)) end
  return #expired
end

local function is_complete(pk, T)
  if redis.call('HGET', pk, 'sealed') ~= '1' then return 0 end
  local rows = tonumber(redis.call('HGET', pk, 'rows') or '0')
  local consumed = tonumber(redis.call('HGET', pk .. ':consumed', T) or '0')
  if consumed >= rows then return 1 end
  return 0
end

local function split_names(csv)
  local out = {}
  for x in string.gmatch(csv or '', '[^,]+') do out[#out + 1] = x end
  return out
end

-- Lost rows that T had not consumed. A group a live lease of T holds stays in it, marked lost under it
-- (`:lostg`): its holder may have read it before the loss, so its ack decides (acked: consumed; released
-- or expired: lost then, requeue_lease). The others are lost now (lose_groups) and taken out of T's queue
-- and partial-group counts. True if any was lost now.
local function drop_lost_for_task(K, P, T, rows)
  local _, tgs = need_task(K, T, nil)
  local tk = tkey(K, P, T)
  local groups, seen, starts = {}, {}, {}
  for _, r in ipairs(rows) do
    local g = math.floor(r / tgs)
    if not seen[g] then seen[g] = true; groups[#groups + 1] = g; starts[#starts + 1] = g * tgs end
  end
  local done = get_bits(tk .. ':done', starts)
  local names = {}
  for i, g in ipairs(groups) do if done[i] == 0 then names[#names + 1] = istr(g) end end
  local held = {}
  for _, id in ipairs(redis.call('ZRANGE', tk .. ':leases', 0, -1)) do
    local lk = K .. ':lease:' .. id
    for i = 1, #names, CHUNK do
      local part = {unpack(names, i, math.min(i + CHUNK - 1, #names))}
      local flags, marks = redis.call('HMGET', lk .. ':pend', unpack(part)), {}
      for k, flag in ipairs(flags) do
        if flag then held[part[k]] = true; marks[#marks + 1] = part[k]; marks[#marks + 1] = 1 end
      end
      if #marks > 0 then redis.call('HSET', lk .. ':lostg', unpack(marks)) end
    end
  end
  local free = {}
  for _, g in ipairs(names) do if not held[g] then free[#free + 1] = g end end
  if #free == 0 then return false end
  lose_groups(K, P, T, tgs, free)
  for i = 1, #free, CHUNK do
    local part = {unpack(free, i, math.min(i + CHUNK - 1, #free))}
    redis.call('ZREM', tk .. ':q', unpack(part))
    redis.call('HDEL', tk .. ':gcnt', unpack(part))
  end
  return true
end

local function check_schemas(pk, args, first, nf)
  for i = 0, nf - 1 do
    local name, sch = args[first + 2 * i], args[first + 2 * i + 1]
    local cur = redis.call('HGET', pk .. ':schema', name)
    if cur and cur ~= sch then
      fail('INVALID_ARGUMENT', 'field ' .. name .. ' is ' .. cur .. ' (fixed by its first write); this write is ' .. sch)
    end
  end
end

---------------------------------------------------------------- partitions

-- args: K, P, group_size, block, exist_ok(0|1), max_partitions
redis.register_function('tq_create_partition', function(keys, args)
  local K, P, gs, block, exist_ok = args[1], args[2], tonumber(args[3]), tonumber(args[4]), args[5] == '1'
  local pk = pkey(K, P)
  if redis.call('EXISTS', pk) == 1 then
    if exist_ok and tonumber(redis.call('HGET', pk, 'gs')) == gs then return 0 end
    fail('ALREADY_EXISTS', 'partition ' .. P .. ' exists (group size ' .. redis.call('HGET', pk, 'gs') .. ')')
  end
  local cap = tonumber(args[6])
  if redis.call('ZCARD', K .. ':partitions') >= cap then
    fail('RESOURCE_EXHAUSTED', istr(cap) .. ' partitions exist (--max-partitions): clear some first')
  end
  local now = now_ms()
  local live = redis.call('ZRANGEBYSCORE', K .. ':shard_ttl', now, '+inf')
  if #live == 0 then fail('FAILED_PRECONDITION', 'no storage shard is registered with the controller') end
  table.sort(live)
  redis.call('HSET', pk, 'gs', gs, 'block', block, 'alloc', 0, 'rows', 0, 'sealed', 0, 'created', now,
             'shards', table.concat(live, ','))
  redis.call('ZADD', K .. ':partitions', now, P)
  return 1
end)

-- args: K, P -> 1 if it existed, plus its shard ids csv
redis.register_function('tq_clear_partition', function(keys, args)
  local K, P = args[1], args[2]
  local pk = pkey(K, P)
  if redis.call('EXISTS', pk) == 0 then return {0, ''} end
  local shards = redis.call('HGET', pk, 'shards') or ''
  local tasks = redis.call('HKEYS', K .. ':tasks')
  for _, T in ipairs(tasks) do if applies(P, T) then
    local tk = tkey(K, P, T)
    for _, id in ipairs(redis.call('ZRANGE', tk .. ':leases', 0, -1)) do
      redis.call('DEL', K .. ':lease:' .. id, K .. ':lease:' .. id .. ':pend', K .. ':lease:' .. id .. ':lostg')
    end
    redis.call('DEL', tk .. ':rdy', tk .. ':gcnt', tk .. ':q', tk .. ':done', tk .. ':leases', tk .. ':lost')
  end end
  for _, f in ipairs(redis.call('HKEYS', pk .. ':schema')) do redis.call('DEL', pk .. ':f:' .. f) end
  redis.call('DEL', pk, pk .. ':schema', pk .. ':any', pk .. ':fcount', pk .. ':nready', pk .. ':consumed',
             pk .. ':leased', pk .. ':lost', pk .. ':tlost')
  redis.call('ZREM', K .. ':partitions', P)
  notify(K, P)
  return {1, shards}
end)

redis.register_function('tq_seal_partition', function(keys, args)
  local K, P = args[1], args[2]
  local pk = need_partition(K, P)
  redis.call('HSET', pk, 'sealed', 1)
  notify(K, P)
  return 1
end)

---------------------------------------------------------------- tasks

-- A task registered late or reset recomputes its readiness over the rows already there: refused, before
-- anything changes, when that is more than `limit` rows, so that one call's work in Redis stays bounded.
local function check_readiness_work(T, rows, partitions, limit)
  if rows > limit then
    fail('FAILED_PRECONDITION', 'task ' .. T .. ' would recompute readiness over ' .. istr(rows) ..
         ' rows in ' .. istr(partitions) .. ' partition(s), more than ' .. istr(limit) ..
         ' (--max-readiness-rows); register tasks before their partitions fill')
  end
end

-- args: K, T, definition json, max_tasks, max_readiness_rows
redis.register_function('tq_register_task', function(keys, args)
  local K, T, def = args[1], args[2], args[3]
  local cur = redis.call('HGET', K .. ':tasks', T)
  if cur then
    if cur == def then return 0 end
    fail('ALREADY_EXISTS', 'task ' .. T .. ' is registered as ' .. cur .. '; not as ' .. def)
  end
  local cap = tonumber(args[4])
  if redis.call('HLEN', K .. ':tasks') >= cap then
    fail('RESOURCE_EXHAUSTED', istr(cap) .. ' tasks are registered (--max-tasks)')
  end
  local rows, parts = 0, 0
  for _, P in ipairs(redis.call('ZRANGE', K .. ':partitions', 0, -1)) do
    if applies(P, T) then
      rows = rows + tonumber(redis.call('HGET', pkey(K, P), 'alloc') or '0')
      parts = parts + 1
    end
  end
  check_readiness_work(T, rows, parts, tonumber(args[5]))
  redis.call('HSET', K .. ':tasks', T, def)
  local d = cjson.decode(def)
  for _, P in ipairs(redis.call('ZRANGE', K .. ':partitions', 0, -1)) do
    if applies(P, T) then
      init_task_partition(K, P, T, d.fields, tonumber(d.group_size))
      notify(K, P)
    end
  end
  return 1
end)

-- args: K, P, T, max_readiness_rows
redis.register_function('tq_reset_task', function(keys, args)
  local K, P, T = args[1], args[2], args[3]
  local pk = need_partition(K, P)
  local fields, gs = need_task(K, T, P)
  check_readiness_work(T, tonumber(redis.call('HGET', pk, 'alloc') or '0'), 1, tonumber(args[4]))
  local tk = tkey(K, P, T)
  for _, id in ipairs(redis.call('ZRANGE', tk .. ':leases', 0, -1)) do
    local lk = K .. ':lease:' .. id
    redis.call('DEL', lk .. ':pend', lk .. ':lostg')
    redis.call('HSET', lk, 'state', 'reset')
    redis.call('PEXPIRE', lk, 3600000)
  end
  redis.call('DEL', tk .. ':rdy', tk .. ':gcnt', tk .. ':q', tk .. ':done', tk .. ':leases')
  redis.call('HDEL', pk .. ':nready', T)
  redis.call('HDEL', pk .. ':consumed', T)
  redis.call('HDEL', pk .. ':leased', T)
  init_task_partition(K, P, T, fields, gs)
  notify(K, P)
  return tonumber(redis.call('HGET', pk .. ':nready', T) or '0')
end)

---------------------------------------------------------------- puts

-- Validate schemas and allocate (or check) rows. Nothing becomes visible.
-- args: K, P, max_partition_rows, nf, (name, schema)*nf, new_rows, rows...
-- returns: first allocated row (new rows) or -1
redis.register_function('tq_prepare_put', function(keys, args)
  local K, P, cap, nf = args[1], args[2], tonumber(args[3]), tonumber(args[4])
  local pk = need_partition(K, P)
  check_schemas(pk, args, 5, nf)
  local new_rows = tonumber(args[5 + 2 * nf])
  if new_rows > 0 then
    if redis.call('HGET', pk, 'sealed') == '1' then
      fail('FAILED_PRECONDITION', 'partition ' .. P .. ' is sealed: no new rows')
    end
    local gs = tonumber(redis.call('HGET', pk, 'gs'))
    if new_rows % gs ~= 0 then
      fail('INVALID_ARGUMENT', 'partition ' .. P .. ' takes whole groups of ' .. gs .. ' rows; got ' .. new_rows)
    end
    local alloc = tonumber(redis.call('HGET', pk, 'alloc'))
    if alloc + new_rows > cap then
      fail('RESOURCE_EXHAUSTED', 'partition ' .. P .. ' has ' .. istr(alloc) .. ' rows allocated; ' .. istr(new_rows) ..
           ' more would pass ' .. istr(cap) .. ' (--max-partition-rows)')
    end
    return redis.call('HINCRBY', pk, 'alloc', new_rows) - new_rows
  end
  local alloc = tonumber(redis.call('HGET', pk, 'alloc'))
  local rows = {}
  for i = 6 + 2 * nf, #args do
    local r = tonumber(args[i])
    if r < 0 or r >= alloc then fail('NOT_FOUND', 'row ' .. args[i] .. ' of partition ' .. P .. ' does not exist') end
    rows[#rows + 1] = r
  end
  -- produced fields are immutable: producers add fields, they never rewrite what readers may have seen
  for i = 0, nf - 1 do
    local f = args[5 + 2 * i]
    local have = get_bits(pk .. ':f:' .. f, rows)
    for k, r in ipairs(rows) do
      if have[k] == 1 then
        fail('ALREADY_EXISTS', 'field ' .. f .. ' of row ' .. istr(r) .. ' in partition ' .. P .. ' is already produced')
      end
    end
  end
  return -1
end)

-- Mark fields produced for rows (their bytes are already on the shards); rows may become ready.
-- args: K, P, nf, (name, schema)*nf, ns, (shard id, incarnation)*ns, rows...
redis.register_function('tq_commit_put', function(keys, args)
  local K, P, nf = args[1], args[2], tonumber(args[3])
  local pk = need_partition(K, P)
  check_schemas(pk, args, 4, nf)
  local ns = tonumber(args[4 + 2 * nf])
  for i = 5 + 2 * nf, 4 + 2 * nf + 2 * ns, 2 do  -- the shards that stored the bytes: still that incarnation?
    if redis.call('HGET', K .. ':shard_inc', args[i]) ~= args[i + 1] then
      fail('ABORTED', 'storage shard ' .. args[i] .. ' came back without its data after it stored this put; put again')
    end
  end
  local alloc = tonumber(redis.call('HGET', pk, 'alloc'))
  local rows = {}
  for i = 5 + 2 * nf + 2 * ns, #args do
    local r = tonumber(args[i])
    if r < 0 or r >= alloc then fail('NOT_FOUND', 'row ' .. args[i] .. ' of partition ' .. P .. ' does not exist') end
    rows[#rows + 1] = r
  end
  local fields, fieldset = {}, {}
  for i = 0, nf - 1 do
    local name = args[4 + 2 * i]
    redis.call('HSETNX', pk .. ':schema', name, args[5 + 2 * i])
    fields[#fields + 1] = name
    fieldset[name] = true
  end
  local new_live = #set_new(pk .. ':any', rows)
  if new_live > 0 then redis.call('HINCRBY', pk, 'rows', new_live) end
  for _, f in ipairs(fields) do
    local produced = #set_new(pk .. ':f:' .. f, rows)
    if produced > 0 then redis.call('HINCRBY', pk .. ':fcount', f, produced) end
  end
  local tasks = redis.call('HGETALL', K .. ':tasks')
  for j = 1, #tasks, 2 do
    local T, d = tasks[j], cjson.decode(tasks[j + 1])
    local touched = false
    if applies(P, T) then
      for _, f in ipairs(d.fields) do if fieldset[f] then touched = true end end
    end
    if touched then
      mark_ready(K, P, T, tonumber(d.group_size), rows_with_fields(pk, d.fields, rows, fieldset))
    end
  end
  notify(K, P)
  return #rows
end)

-- args: K, P, fields... -> error unless every row has every field
-- (rows come after a '--' separator)
redis.register_function('tq_check_rows', function(keys, args)
  local K, P = args[1], args[2]
  local pk = need_partition(K, P)
  local fields, i = {}, 3
  while args[i] ~= '--' do fields[#fields + 1] = args[i]; i = i + 1 end
  for _, f in ipairs(fields) do
    if redis.call('HEXISTS', pk .. ':schema', f) == 0 then
      fail('NOT_FOUND', 'field ' .. f .. ' does not exist in partition ' .. P)
    end
  end
  local alloc = tonumber(redis.call('HGET', pk, 'alloc'))
  local rows = {}
  for j = i + 1, #args do
    local r = tonumber(args[j])
    if r < 0 or r >= alloc then fail('NOT_FOUND', 'row ' .. args[j] .. ' of partition ' .. P .. ' does not exist') end
    rows[#rows + 1] = r
  end
  for _, f in ipairs(fields) do
    local have = get_bits(pk .. ':f:' .. f, rows)
    for k, r in ipairs(rows) do
      if have[k] == 0 then
        fail('NOT_FOUND', 'field ' .. f .. ' of row ' .. istr(r) .. ' in partition ' .. P .. ' is not produced')
      end
    end
  end
  return 1
end)

---------------------------------------------------------------- claims and leases

-- args: K, P, T, batch_rows, min_rows, lease_ms, lease_id, claim_key
-- returns: {lease_id|'', groups csv, expiry|next lease expiry|0, complete, gs, ready_groups_left}
redis.register_function('tq_claim', function(keys, args)
  local K, P, T = args[1], args[2], args[3]
  local batch, min_rows, lease_ms, id, ckey = tonumber(args[4]), tonumber(args[5]), tonumber(args[6]), args[7], args[8]
  local pk = need_partition(K, P)
  local fields, gs = need_task(K, T, P)
  if batch <= 0 or batch % gs ~= 0 then
    fail('INVALID_ARGUMENT', 'batch_size ' .. batch .. ' is not a positive multiple of task ' .. T .. "'s group size " .. gs)
  end
  local want = batch / gs
  local min_groups = math.max(1, math.min(want, math.ceil(min_rows / gs)))
  local pgs = tonumber(redis.call('HGET', pk, 'gs'))
  if pgs % gs ~= 0 then
    fail('FAILED_PRECONDITION', 'task ' .. T .. ' claims groups of ' .. gs .. ' but partition ' .. P .. ' holds groups of ' .. pgs)
  end
  local tk = tkey(K, P, T)
  local now = now_ms()
  reap(K, P, T, now)
  if ckey ~= '' then
    local existing = redis.call('GET', tk .. ':key:' .. ckey)
    -- every caller with the key gets the same lease, whatever became of it since (ranks that
    -- arrive late must see the batch the others split, even if it is acked by now), unless it was
    -- released or its task reset: its rows are back in the queue and the key's holder claims again (a
    -- claim answered short at its deadline and given back must not get the same short batch forever)
    if existing then
      local lk = K .. ':lease:' .. existing
      local state = redis.call('HGET', lk, 'state')
      if state and state ~= 'released' and state ~= 'reset' then
        return {existing, redis.call('HGET', lk, 'groups'), tonumber(redis.call('HGET', lk, 'expiry')),
                is_complete(pk, T), gs, redis.call('ZCARD', tk .. ':q')}
      end
    end
  end
  local avail = redis.call('ZCARD', tk .. ':q')
  local complete = is_complete(pk, T)
  local enough = avail >= min_groups
  if not enough and avail > 0 and redis.call('HGET', pk, 'sealed') == '1' then
    -- nothing more can become ready: do not wait for a full batch
    local rows = tonumber(redis.call('HGET', pk, 'rows') or '0')
    enough = tonumber(redis.call('HGET', pk .. ':nready', T) or '0') >= rows
  end
  if avail == 0 or not enough then
    local first = redis.call('ZRANGE', tk .. ':leases', 0, 0, 'WITHSCORES')
    local next_expiry = 0
    if #first > 0 then next_expiry = tonumber(first[2]) end
    return {'', '', next_expiry, complete, gs, avail}
  end
  local popped = redis.call('ZPOPMIN', tk .. ':q', want)
  local groups = {}
  local lk = K .. ':lease:' .. id
  local pend = {}
  for j = 1, #popped, 2 do
    groups[#groups + 1] = popped[j]
    pend[#pend + 1] = popped[j]; pend[#pend + 1] = 1
  end
  for j = 1, #pend, 2 * CHUNK do
    redis.call('HSET', lk .. ':pend', unpack(pend, j, math.min(j + 2 * CHUNK - 1, #pend)))
  end
  local expiry = now + lease_ms
  local csv = table.concat(groups, ',')
  redis.call('HSET', lk, 'p', P, 't', T, 'gs', gs, 'groups', csv, 'expiry', expiry, 'state', 'live')
  redis.call('ZADD', tk .. ':leases', expiry, id)
  redis.call('HINCRBY', pk .. ':leased', T, #groups * gs)
  if ckey ~= '' then
    redis.call('SET', tk .. ':key:' .. ckey, id, 'PX', lease_ms + 3600000)
    redis.call('HSET', lk, 'key', ckey)
  end
  return {id, csv, expiry, complete, gs, avail - #groups}
end)

-- args: K, lease_id, rows... (none = all)
redis.register_function('tq_ack', function(keys, args)
  local K, id = args[1], args[2]
  local lk, st = need_lease(K, id)
  if st == 'acked' then return 0 end
  if st ~= 'live' then fail('FAILED_PRECONDITION', 'lease ' .. id .. ' is ' .. st .. '; its rows were handed out again') end
  local expiry = tonumber(redis.call('HGET', lk, 'expiry'))
  local now = now_ms()
  if expiry <= now then
    local P, T = redis.call('HGET', lk, 'p'), redis.call('HGET', lk, 't')
    reap(K, P, T, now)
    notify(K, P)
    fail('FAILED_PRECONDITION', 'lease ' .. id .. ' expired ' .. (now - expiry) .. ' ms ago; its rows were handed out again')
  end
  local P, T, gs = redis.call('HGET', lk, 'p'), redis.call('HGET', lk, 't'), tonumber(redis.call('HGET', lk, 'gs'))
  local pk, tk = pkey(K, P), tkey(K, P, T)
  local targets = {}
  if #args > 2 then
    local member, counts = {}, {}
    for _, g in ipairs(split_csv(redis.call('HGET', lk, 'groups'))) do member[g] = true end
    for j = 3, #args do
      local r = tonumber(args[j])
      local g = math.floor(r / gs)
      if not member[g] then fail('INVALID_ARGUMENT', 'row ' .. args[j] .. ' is not in lease ' .. id) end
      if counts[g] == nil then targets[#targets + 1] = g; counts[g] = 0 end
      counts[g] = counts[g] + 1
    end
    for g, c in pairs(counts) do
      if c ~= gs then fail('INVALID_ARGUMENT', 'acks must cover whole groups of ' .. gs .. ' rows; group ' .. g .. ' has ' .. c) end
    end
  else
    for _, g in ipairs(redis.call('HKEYS', lk .. ':pend')) do targets[#targets + 1] = tonumber(g) end
  end
  local pending, done_rows = {}, {}
  for i = 1, #targets, CHUNK do
    local names = {}
    for j = i, math.min(i + CHUNK - 1, #targets) do names[#names + 1] = istr(targets[j]) end
    local flags = redis.call('HMGET', lk .. ':pend', unpack(names))
    for k, flag in ipairs(flags) do if flag then pending[#pending + 1] = names[k] end end
  end
  for i = 1, #pending, CHUNK do
    redis.call('HDEL', lk .. ':pend', unpack(pending, i, math.min(i + CHUNK - 1, #pending)))
  end
  for _, g in ipairs(pending) do
    for r = tonumber(g) * gs, tonumber(g) * gs + gs - 1 do done_rows[#done_rows + 1] = r end
  end
  set_new(tk .. ':done', done_rows)
  local n = #done_rows
  if n > 0 then
    redis.call('HINCRBY', pk .. ':consumed', T, n)
    redis.call('HINCRBY', pk .. ':leased', T, -n)
  end
  if redis.call('HLEN', lk .. ':pend') == 0 then
    redis.call('DEL', lk .. ':lostg')  -- groups lost under it and acked: the holder had read them
    redis.call('HSET', lk, 'state', 'acked')
    redis.call('ZREM', tk .. ':leases', id)
    redis.call('PEXPIRE', lk, 3600000)
  end
  notify(K, P)
  return n
end)

-- args: K, lease_id
redis.register_function('tq_release', function(keys, args)
  local K, id = args[1], args[2]
  local lk, st = need_lease(K, id)
  if st == 'released' then return 0 end
  if st ~= 'live' then fail('FAILED_PRECONDITION', 'lease ' .. id .. ' is ' .. st .. ' and cannot be released') end
  local n = requeue_lease(K, id, 'released')
  notify(K, redis.call('HGET', lk, 'p'))
  return n
end)

-- args: K, lease_id, lease_ms -> new expiry
redis.register_function('tq_extend_lease', function(keys, args)
  local K, id, lease_ms = args[1], args[2], tonumber(args[3])
  local lk, st = need_lease(K, id)
  local now = now_ms()
  local P, T = redis.call('HGET', lk, 'p'), redis.call('HGET', lk, 't')
  if st == 'live' and tonumber(redis.call('HGET', lk, 'expiry')) <= now then
    reap(K, P, T, now)
    notify(K, P)
    st = 'expired'
  end
  if st ~= 'live' then fail('FAILED_PRECONDITION', 'lease ' .. id .. ' is ' .. st .. ' and cannot be extended') end
  local expiry = now + lease_ms
  redis.call('HSET', lk, 'expiry', expiry)
  redis.call('ZADD', tkey(K, P, T) .. ':leases', expiry, id)
  local key = redis.call('HGET', lk, 'key')
  if key then redis.call('PEXPIRE', tkey(K, P, T) .. ':key:' .. key, lease_ms + 3600000) end
  return expiry
end)

-- args: K, P, T -> {ready groups, complete, next lease expiry}
redis.register_function('tq_ready', function(keys, args)
  local K, P, T = args[1], args[2], args[3]
  local pk = need_partition(K, P)
  need_task(K, T, P)
  local tk = tkey(K, P, T)
  local now = now_ms()
  reap(K, P, T, now)
  local first = redis.call('ZRANGE', tk .. ':leases', 0, 0, 'WITHSCORES')
  local next_expiry = 0
  if #first > 0 then next_expiry = tonumber(first[2]) end
  return {tonumber(redis.call('HGET', pk .. ':nready', T) or '0'), is_complete(pk, T), next_expiry}
end)

---------------------------------------------------------------- shards

-- args: K, shard_id, address, ttl_ms, incarnation -> {1 if the shard came back without its data (its
-- incarnation changed) and its rows are still to be marked lost, else 0, live partitions...}. The sweep
-- stays pending until tq_shard_incarnation ends it, so a controller that dies half way through it finds
-- it again at the shard's next registration.
redis.register_function('tq_register_shard', function(keys, args)
  local K, id, addr, ttl, inc = args[1], args[2], args[3], tonumber(args[4]), args[5] or ''
  redis.call('HSET', K .. ':shards', id, addr)
  redis.call('ZADD', K .. ':shard_ttl', now_ms() + ttl, id)
  local reborn = 0
  if inc ~= '' then
    local before = redis.call('HGET', K .. ':shard_inc', id)
    if before and before ~= inc then  -- stored at once: commits of puts the old one took now fail
      redis.call('HSET', K .. ':shard_sweep', id, inc)
    end
    redis.call('HSET', K .. ':shard_inc', id, inc)
    if redis.call('HGET', K .. ':shard_sweep', id) == inc then reborn = 1 end
  end
  local out = {reborn}
  for _, P in ipairs(redis.call('ZRANGE', K .. ':partitions', 0, -1)) do out[#out + 1] = P end
  return out
end)

-- args: K, shard_id, incarnation: its lost rows are marked
redis.register_function('tq_shard_incarnation', function(keys, args)
  if redis.call('HGET', args[1] .. ':shard_sweep', args[2]) == args[3] then
    redis.call('HDEL', args[1] .. ':shard_sweep', args[2])
  end
  return 1
end)

-- Rows of P in [from, to) that the shard held (placed on it and committed) are lost: each of their groups
-- is marked lost; for every task that had not consumed a lost group, the group counts as consumed (it is
-- never handed out again, and is taken out of live leases) and is recorded as lost before that task
-- consumed it. A partition with such groups is unsealed: its producer regenerates them (as new rows)
-- and seals it again. Bounded work: the caller walks a partition in windows.
-- args: K, P, shard_id, from, to -> {groups newly lost, 1 if a task had not consumed one}
redis.register_function('tq_mark_lost', function(keys, args)
  local K, P, shard, from, to = args[1], args[2], args[3], tonumber(args[4]), tonumber(args[5])
  local pk = pkey(K, P)
  if redis.call('EXISTS', pk) == 0 then return {0, 0} end
  local gs, block = tonumber(redis.call('HGET', pk, 'gs')), tonumber(redis.call('HGET', pk, 'block'))
  local shards, index = split_names(redis.call('HGET', pk, 'shards')), nil
  for i, id in ipairs(shards) do if id == shard then index = i - 1 end end
  to = math.min(to, tonumber(redis.call('HGET', pk, 'alloc')))
  if index == nil or from >= to then return {0, 0} end
  local candidates = {}
  for r = from, to - 1 do
    if math.floor(r / block) % #shards == index then candidates[#candidates + 1] = r end
  end
  local held = get_bits(pk .. ':any', candidates)
  local groups, seen = {}, {}
  for i, r in ipairs(candidates) do
    local g = math.floor(r / gs)
    if held[i] == 1 and not seen[g] then
      seen[g] = true
      if redis.call('GETBIT', pk .. ':lost', g * gs) == 0 then groups[#groups + 1] = g end
    end
  end
  if #groups == 0 then return {0, 0} end
  local rows = {}
  for _, g in ipairs(groups) do for r = g * gs, g * gs + gs - 1 do rows[#rows + 1] = r end end
  set_new(pk .. ':lost', rows)
  redis.call('HINCRBY', pk, 'lost', #rows)
  local needed = 0
  for _, T in ipairs(redis.call('HKEYS', K .. ':tasks')) do
    if applies(P, T) and drop_lost_for_task(K, P, T, rows) then needed = 1 end
  end
  if needed == 1 then redis.call('HSET', pk, 'sealed', 0) end
  notify(K, P)
  return {#groups, needed}
end)

-- args: K, P, T, from, limit -> rows >= from lost before T consumed them (at most limit), ascending
redis.register_function('tq_lost_rows', function(keys, args)
  local K, P, T, from, limit = args[1], args[2], args[3], tonumber(args[4]), tonumber(args[5])
  need_partition(K, P)
  need_task(K, T, P)
  local key, out, pos = tkey(K, P, T) .. ':lost', {}, from
  while #out < limit do
    pos = redis.call('BITPOS', key, 1, pos, -1, 'BIT')
    if pos < 0 then break end
    out[#out + 1] = pos
    pos = pos + 1
  end
  return out
end)

-- args: K -> flat {id, address, ...} of live shards
redis.register_function('tq_list_shards', function(keys, args)
  local K = args[1]
  local live = redis.call('ZRANGEBYSCORE', K .. ':shard_ttl', now_ms(), '+inf')
  table.sort(live)
  local out = {}
  for _, id in ipairs(live) do
    out[#out + 1] = id
    out[#out + 1] = redis.call('HGET', K .. ':shards', id)
  end
  return out
end)
