--[[
  state.lua: snapshot reading, the fit test, lease/window/waiter transitions, bounded
  reaping and FIFO advance. Needs common.lua. Parameters read from P (the caller's knobs):
    adm (0/1 admission on), res (0/1 residency on), hw (high_watermark), pt (pressure_threshold),
    headroom, budget_scale (a fixed budget scale, or -1: the snapshot's measured one),
    stale_ms (staleness), grace_ms (idle_grace), ttl_ms (lease TTL),
    claim_ms (how long a FIFO grant waits to be claimed), reap (max items per reap pass).
]]

-- the latest snapshot: fresh (bool), usage (0..1), capacity (tokens), nh (healthy engines),
-- scale (the budget scale in use) and ceiling (tokens: capacity x headroom x scale).
-- The budget scale is how far the held sessions may over-commit the pool (docs/budget.md):
-- the caller's fixed budget_scale when it sets one, else the one the poller's controller
-- measured, while that is fresher than staleness; else 1, the ledger of the seeds.
local function snapshot()
  local v = redis.call("HMGET", K.snapshot, "ts_ms", "usage", "capacity", "n_healthy",
    "budget_scale", "budget_ts_ms")
  local ts = tonumber(v[1])
  local s = { fresh = false, usage = num(v[2], 0), capacity = num(v[3], 0), ceiling = 0,
    nh = num(v[4], 0), scale = 1 }
  if ts ~= nil and s.nh > 0 and (NOW - ts) <= P.stale_ms then
    s.fresh = true
  end
  if P.budget_scale > 0 then
    s.scale = P.budget_scale
  else
    local bts = tonumber(v[6])
    if bts ~= nil and (NOW - bts) <= P.stale_ms and num(v[5], 0) > 0 then s.scale = tonumber(v[5]) end
  end
  s.ceiling = math.floor(s.capacity * P.headroom * s.scale)
  return s
end

-- why a turn of `need` tokens may not enter by rule 6 (nil: it fits). A turn larger than the
-- whole ceiling fits once nothing else is charged: else it could enter only by aging, and
-- while other turns flow aging waits for max_wait_hard_s
local function block_reason(snap, need)
  if P.adm == 1 then
    if snap.usage >= P.pt then return "pressure_guard" end
    if reserved() + math.min(need, snap.ceiling) > snap.ceiling then return "capacity_exhausted" end
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
  progress()
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
  if P.grace_ms <= 0 then
    end_window(session, win)
    return
  end
  win.h = 0
  win.x = NOW + P.grace_ms
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
  -- the budget's share of the engines' whole capacity (ceiling / headroom) are windows
  -- revoked, down to the ceiling. A scale below 1 admits fewer newcomers but never revokes
  -- windows the pool still holds: the trim works as at scale 1 then.
  local over = math.max(1, snap.scale)
  local r = reserved()
  if r <= snap.capacity * over then return 0 end
  local excess = r - math.floor(snap.capacity * P.headroom * over)
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
  redis.call("HINCRBY", K.ledger, "n_released", 1)
  progress()
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

-- open a lease for a turn of `need` tokens, `prompt` of them its prompt, `prev` the prompt of
-- the session's last turn (0: none known); with `win_mode` the charge goes to the session's
-- window:
--   "join"  the session owns a window: hold it (first holder re-sizes its charge)
--   "open"  open (or keep) the window for this session (admitted under pressure)
local function grant(ticket, session, need, prompt, prev, reason, enq_ms, win_mode, claim)
  local l = { s = session, t = need, w = 0, a = NOW, e = enq_ms or NOW, r = reason, ep = epoch(), c = 0 }
  -- what the engines should still hold of this prompt: the session's last prompt, when this
  -- one extends it; the rest is new to them (the budget controller's re-prefill estimate,
  -- docs/budget.md)
  local reuse = 0
  if prev > 0 and prompt >= prev then reuse = prev end
  redis.call("HINCRBY", K.ledger, "tok_reusable", I(reuse))
  redis.call("HINCRBY", K.ledger, "tok_fresh", I(prompt - reuse))
  if win_mode ~= nil then
    local win = jget(K.windows, session)
    if win == nil then
      win = { t = need, h = 1, ep = epoch(), x = 0, id = redis.call("HINCRBY", K.ledger, "wseq", 1) }
      redis.call("ZADD", K.window_order, I(win.id), session)
      charge(need)
      l.t = 0
      l.w = 1
    elseif win.h == 0 then
      -- the charge follows the session's latest turn both ways (a reset context shrinks it)
      charge(need - win.t)
      win.t = need
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
  local exp = NOW + P.ttl_ms
  if claim then
    l.c = 1
    exp = NOW + math.min(P.claim_ms, P.ttl_ms)
  end
  jset(K.leases, ticket, l)
  redis.call("ZADD", K.lease_exp, I(exp), ticket)
  stat("admit")
  stat("admit_" .. reason)
  -- an aged admission is the liveness guard acting, not progress (SPEC 4): else every
  -- waiter behind a stalled head would wait max_wait_s more, one after another
  if reason ~= "aged" then progress() end
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
      local win_mode = opens_window(w.r, snap.usage) and "open" or nil
      if block_reason(snap, w.n) ~= nil then break end
      drop_waiter(head, w)
      grant(head, w.s, w.n, w.p, w.v or 0, "open", w.e, win_mode, true)
      publish("g " .. head)
      granted = granted + 1
    end
  end
  return granted
end
