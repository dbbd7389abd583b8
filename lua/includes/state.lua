--[[
  state.lua: snapshot reading, the fit test, lease/window/waiter transitions, bounded
  reaping and FIFO advance. Needs common.lua. Parameters read from P (the caller's knobs):
    adm (0/1 admission on), res (0/1 residency on), hw (high_watermark), pt (pressure_threshold),
    headroom, oc (overcommit: how far windows may outgrow the pool before the trim),
    stale_ms (staleness), grace_ms (idle_grace), ttl_ms (lease TTL),
    claim_ms (how long a FIFO grant waits to be claimed), reap (max items per reap pass).
]]

-- the latest snapshot: fresh (bool), usage (0..1), capacity (tokens), ceiling (tokens),
-- nh (healthy engines), pst (prefill s per uncached token), pl (prefill load); -1: not measured
local function snapshot()
  local v = redis.call("HMGET", K.snapshot, "ts_ms", "usage", "capacity", "n_healthy",
    "prefill_s_per_token", "prefill_load")
  local ts = tonumber(v[1])
  local s = { fresh = false, usage = num(v[2], 0), capacity = num(v[3], 0), ceiling = 0,
    nh = num(v[4], 0), pst = num(v[5], -1), pl = num(v[6], -1) }
  if ts ~= nil and s.nh > 0 and (NOW - ts) <= num(P.stale_ms, 6000) then
    s.fresh = true
  end
  s.ceiling = math.floor(s.capacity * num(P.headroom, 0.9))
  return s
end

-- why a turn of `need` tokens may not enter by rule 6 (nil: it fits)
local function block_reason(snap, need)
  if P.adm == 1 then
    if snap.usage >= P.pt then return "pressure_guard" end
    if reserved() + need > snap.ceiling then return "capacity_exhausted" end
  end
  if P.res == 1 and snap.usage >= P.hw then return "cold_prefix" end
  return nil
end

-- when a waiter's wait began, for its age (max_wait_s): when its attempt began (b, before a
-- probe round trip), as the caller's own deadline counts, else when it entered the FIFO (e)
local function waiter_since(w)
  return num(w.b, w.e)
end

local function drop_waiter(ticket, w)
  redis.call("ZREM", K.fifo, ticket)
  redis.call("HDEL", K.waiters, ticket)
  redis.call("ZREM", K.alive, ticket)
  if w and redis.call("HGET", K.session_waiter, w.s) == ticket then
    redis.call("HDEL", K.session_waiter, w.s)
  end
end

local function end_window(session, win)
  redis.call("HDEL", K.windows, session)
  redis.call("ZREM", K.window_exp, session)
  redis.call("ZREM", K.window_order, session)
  -- leases still running under it (finish_session mid-turn) hold no charge of their own,
  -- so their later release gives back nothing: the window's charge is returned once, here
  charge(-win.t)
end

-- idle window: start its grace; end it at once when grace is 0 or it was revoked
local function window_idle(session, win)
  if win.rv == 1 then
    end_window(session, win)
    stat("window_revoked")
    return
  end
  if num(P.grace_ms, 60000) <= 0 then
    end_window(session, win)
    return
  end
  win.h = 0
  win.x = NOW + num(P.grace_ms, 60000)
  jset(K.windows, session, win)
  redis.call("ZADD", K.window_exp, I(win.x), session)
end

-- does a retained admission open (or keep) an ownership window? With admission on, always:
-- the ledger must charge the prefixes of sessions between turns, which the engines' usage
-- gauges count as free. With residency alone, only under pressure (seed 000).
local function opens_window(retain, usage)
  return P.res == 1 and retain == 1 and (P.adm == 1 or usage >= P.hw)
end

-- the ledger is over-committed (windows grew past the ceiling): revoke windows, bounded.
-- Idle windows go first, the longest idle first: a session deep in a long tool call owns the
-- blocks the engines' LRU evicts first once the pool overflows, so its window is the one whose
-- KV is lost anyway (as in evict_idle below). Then windows a running turn holds, the youngest
-- first; those end at their lease's release. The oldest window always stays.
local function trim(snap, limit)
  if P.adm ~= 1 or P.res ~= 1 or not snap.fresh then return 0 end
  -- hysteresis: windows may grow past the ceiling (rules 5 and 7); only when they outgrow
  -- overcommit x the engines' whole capacity are windows revoked, down to overcommit x
  -- the ceiling (overcommit 1: the pool and the ceiling themselves)
  local r = reserved()
  local oc = num(P.oc, 1)
  if r <= snap.capacity * oc then return 0 end
  local excess = r - math.floor(snap.ceiling * oc)
  local n = 0
  local oldest = redis.call("ZRANGE", K.window_order, 0, 0)[1]
  -- window_exp holds idle windows only, scored by grace expiry: the earliest was released first
  local order = redis.call("ZRANGE", K.window_exp, 0, limit - 1)
  for _, s in ipairs(redis.call("ZREVRANGE", K.window_order, 0, limit - 1)) do
    order[#order + 1] = s
  end
  for _, s in ipairs(order) do
    if excess <= 0 then break end
    -- the oldest window always stays: revoking the last session cannot make room for anyone
    -- (an idle window is listed twice; once ended, its second listing finds nothing)
    local win = nil
    if s ~= oldest then win = jget(K.windows, s) end
    if win and win.h == 0 then
      end_window(s, win)
      stat("window_revoked")
      excess = excess - win.t
      n = n + 1
    elseif win then
      -- held by a running turn: it ends at that turn's release (marked once, counted always)
      if win.rv ~= 1 then
        win.rv = 1
        jset(K.windows, s, win)
      end
      excess = excess - win.t
    elseif s ~= oldest then
      redis.call("ZREM", K.window_order, s)
    end
  end
  return n
end

-- make room for `need` tokens by ending idle windows, the longest idle first, bounded by
-- `limit`: a session deep in a long tool call owns the blocks the engines' LRU evicts next
-- anyway, so its window is the cheapest place to give up. Returns how many ended.
local function evict_idle(snap, need, limit)
  local n = 0
  for _, s in ipairs(redis.call("ZRANGE", K.window_exp, 0, limit - 1)) do
    if reserved() + need <= snap.ceiling then break end
    local win = jget(K.windows, s)
    if win and win.h == 0 then
      end_window(s, win)
      stat("window_revoked")
      stat("window_yielded")
      n = n + 1
    end
  end
  return n
end

-- a live window of the current epoch, or nil (stale ones are ended here, lazily)
local function live_window(session)
  local win = jget(K.windows, session)
  if not win then return nil end
  if win.ep ~= epoch() and win.h > 0 then
    -- of an old engine set but held by a running turn: ending it now would take that turn's
    -- charge off the ledger while it runs. It ends when its holder releases it (rv), and
    -- this session's other turns meanwhile are charged on their own (grant's branch case)
    if win.rv ~= 1 then
      win.rv = 1
      jset(K.windows, session, win)
    end
    return nil
  end
  if win.ep ~= epoch() or (win.h == 0 and win.x <= NOW) then
    end_window(session, win)
    stat(win.ep ~= epoch() and "window_epoch_dropped" or "window_expired")
    return nil
  end
  return win
end

-- remove a lease and give back what it holds; returns the lease or nil
local function free_lease(ticket)
  local l = jget(K.leases, ticket)
  if not l then return nil end
  redis.call("HDEL", K.leases, ticket)
  redis.call("ZREM", K.lease_exp, ticket)
  if l.w == 1 then
    local win = jget(K.windows, l.s)
    -- only the window this lease was charged to: if that one ended meanwhile (finish,
    -- epoch change) a newer window of the session is not this lease's to release
    if win and win.id == l.wid then
      win.h = math.max(0, win.h - 1)
      if win.h == 0 then
        window_idle(l.s, win)
      else
        jset(K.windows, l.s, win)
      end
    end
  end
  if l.t > 0 then charge(-l.t) end
  return l
end

-- wait_cost_ratio: how long a waiter of `need` tokens may wait when the snapshot says a cold
-- prefill is measured and the engines have time to spare; nil when that bound does not apply
-- (max_wait_ms alone). Time to spare, once clients have reported a typical tool gap: with
-- wait_cost_gap set, a cold prefill of this turn takes at most wait_cost_gap x that gap;
-- else (the default) refilling each engine's share of the pool cold takes at most
-- wait_cost_pool x that gap (whatever the gate protects, the engines rebuild within a few of
-- the sessions' tool calls, so holding turns back buys little). With either knob on, no time
-- to spare until a gap is known: the prefill load then on record was measured before the
-- turns now waiting arrived (a fresh gate's first burst after idle engines reads 0) and says
-- nothing about the engines under them. With both knobs at 0, the prefill load is below
-- wait_cost_load
local function cost_wait_ms(snap, need)
  if num(P.wcr, 0) <= 0 or snap.pst <= 0 then return nil end
  local cold = snap.pst * need
  local wcg, wcp = num(P.wcg, 0), num(P.wcp, 0)
  local spare
  if wcg > 0 or wcp > 0 then
    local g = tool_gap_s()
    if g == nil then return nil end
    if wcg > 0 then
      spare = cold <= wcg * g
    else
      -- the engines refill their whole share of the pool cold within wcp typical tool gaps
      spare = snap.pst * snap.ceiling / math.max(1, snap.nh) <= wcp * g
    end
  else
    spare = snap.pl >= 0 and snap.pl < num(P.wcl, 0.3)
  end
  if spare then return P.wcr * cold * 1000 end
  return nil
end

-- what a window opened now for a turn of `need` tokens reserves: the need grown by
-- growth_reserve (sessions re-send a growing history: a window admitted at its first prompt
-- will hold several times that before it ends), never more than the ceiling, never less than
-- the need. With admission off there is no ledger to reserve in.
local function window_floor(snap, need)
  local g = num(P.gr, 1)
  if g <= 1 or P.adm ~= 1 then return need end
  return math.max(need, math.min(math.floor(need * g), snap.ceiling))
end

-- open a lease; with `win_mode` the charge goes to the session's window:
--   "join"  the session owns a window: hold it (first holder re-sizes its charge)
--   "open"  open (or keep) the window for this session (admitted under pressure)
-- `floor`: what a newly opened window reserves at least (window_floor; default `need`)
local function grant(ticket, session, need, reason, enq_ms, win_mode, claim, floor)
  local l = { s = session, t = need, w = 0, a = NOW, e = enq_ms or NOW, r = reason, ep = epoch(), c = 0 }
  if win_mode ~= nil then
    local win = jget(K.windows, session)
    if win == nil then
      local f = math.max(need, floor or need)
      win = { t = f, h = 1, ep = epoch(), x = 0, id = redis.call("HINCRBY", K.ledger, "wseq", 1) }
      -- only a floor above the need is kept: at growth_reserve 1 the charge follows the
      -- session's latest turn both ways, as before (a reset context shrinks it)
      if f > need then win.f = f end
      redis.call("ZADD", K.window_order, I(win.id), session)
      charge(f)
      l.t = 0
      l.w = 1
    elseif win.h == 0 then
      local t = math.max(need, win.f or 0)
      charge(t - win.t)
      win.t = t
      win.h = 1
      win.x = 0
      redis.call("ZREM", K.window_exp, session)
      l.t = 0
      l.w = 1
    else
      -- a concurrent turn of the same session (a branch): charged on its own
      charge(need)
    end
    if l.w == 1 then
      l.wid = win.id
      jset(K.windows, session, win)
    end
  else
    charge(need)
  end
  local exp = NOW + num(P.ttl_ms, 600000)
  if claim then
    l.c = 1
    exp = NOW + math.min(num(P.claim_ms, 11000), num(P.ttl_ms, 600000))
  end
  jset(K.leases, ticket, l)
  redis.call("ZADD", K.lease_exp, I(exp), ticket)
  stat("admit")
  stat("admit_" .. reason)
  if enq_ms ~= nil and enq_ms < NOW then
    stat("wait_granted")
    stat("wait_ms_sum", NOW - enq_ms)
  end
  return l
end

-- bounded reclaim of expired leases, idle windows and dead waiters
local function reap(limit)
  local n = { leases = 0, windows = 0, waiters = 0 }
  if limit <= 0 then return n end
  for _, t in ipairs(redis.call("ZRANGEBYSCORE", K.lease_exp, "-inf", I(NOW), "LIMIT", 0, limit)) do
    if free_lease(t) then
      stat("lease_expired")
      n.leases = n.leases + 1
    else
      redis.call("ZREM", K.lease_exp, t)
    end
  end
  for _, s in ipairs(redis.call("ZRANGEBYSCORE", K.window_exp, "-inf", I(NOW), "LIMIT", 0, limit)) do
    local win = jget(K.windows, s)
    if win and win.h == 0 and win.x <= NOW then
      end_window(s, win)
      stat("window_expired")
      n.windows = n.windows + 1
    else
      redis.call("ZREM", K.window_exp, s)
    end
  end
  for _, t in ipairs(redis.call("ZRANGEBYSCORE", K.alive, "-inf", I(NOW), "LIMIT", 0, limit)) do
    local w = jget(K.waiters, t)
    drop_waiter(t, w)
    if w and w.st == "w" then stat("dead_waiter") end
    n.waiters = n.waiters + 1
  end
  return n
end

-- grant FIFO heads that fit, oldest first, at most `limit`; stops at the first that does
-- not fit (strict FIFO). Publishes "g <ticket>" for each grant.
local function advance(limit, snap)
  FREED = false
  local granted = 0
  snap = snap or snapshot()
  if not snap.fresh then return 0 end
  for _ = 1, limit do
    local head = redis.call("ZRANGE", K.fifo, 0, 0)[1]
    if not head then break end
    local w = jget(K.waiters, head)
    if not w then
      redis.call("ZREM", K.fifo, head)
    elseif num(redis.call("ZSCORE", K.alive, head), 0) <= NOW then
      drop_waiter(head, w)
      stat("dead_waiter")
    else
      -- a head that would open a window is checked with the window's floor
      local win_mode = opens_window(w.r, snap.usage) and "open" or nil
      local eff = win_mode and window_floor(snap, w.n) or w.n
      if block_reason(snap, eff) ~= nil then break end
      drop_waiter(head, w)
      grant(head, w.s, w.n, "open", w.e, win_mode, true, eff)
      publish("g " .. head)
      granted = granted + 1
    end
  end
  return granted
end
