--[[
  windows.lua: the ownership window record (windows, window_exp, window_order): whether an
  admission opens one, its idle grace at release, its end (the ledger gets its charge back),
  the lazy check of a session's window (rule 5), the trim of an over-committed ledger, the
  eviction of idle windows for an aged admission, and the reap of expired ones. A lease opens
  or joins a window in leases.lua (grant). The record's fields: docs/keys.md#window; its
  states: docs/state-machines.md#window.

  KEYS used: windows, window_exp, window_order; totals, snapshot (read by the trim's order)
  Knobs read: idle_grace_ms (window_idle); residency, admission (opens_window, trim);
    high_watermark (opens_window)
]]
--@include common
--@include prefixes

local function end_window(session, win)
  redis.call("HDEL", K.windows, session)
  redis.call("ZREM", K.window_exp, session)
  redis.call("ZREM", K.window_order, session)
  progress()
  -- leases still running under it (finish_session mid-turn) hold no charge of their own,
  -- so their later release gives back nothing: the window's charge is returned once, here
  charge(-win.t)
  drop_share(win)
end

-- idle window: start its grace; end it at once when grace is 0 or it was revoked
local function window_idle(session, win)
  if win.rv == 1 then
    end_window(session, win)
    stat("window_revoked")
    return
  end
  if P.idle_grace_ms <= 0 then
    end_window(session, win)
    return
  end
  win.h = 0
  win.x = NOW + P.idle_grace_ms
  jset(K.windows, session, win)
  deadline(K.window_exp, win.x, session)
end

-- does a retained admission open (or keep) an ownership window? With admission on, always:
-- the ledger must charge the prefixes of sessions between turns, which the engines' usage
-- gauges count as free. With residency alone, only under pressure (seed 000).
local function opens_window(retain, usage)
  return P.residency == 1 and retain == 1 and (P.admission == 1 or usage >= P.high_watermark)
end

-- the order in which the trim ends idle windows (`idle`: the longest idle first), by the room
-- each frees per what ending it costs (docs/decisions.md#trim-order). Ending a window costs its
-- session a wait in the FIFO when it comes back (the mean wait of the turns the FIFO has
-- granted) and, unless the engines' LRU evicts its blocks anyway, a re-prefill of its charge
-- (the snapshot's prefill cost). The LRU evicts the longest idle first, as many tokens as the
-- ledger holds past the engines' capacity: ending those windows re-prefills nothing that was
-- not lost already. Where prefill is dear this keeps the longest idle first; where it is
-- cheap the largest windows go first, so fewer sessions queue. Without a prefill reading: the
-- longest idle first. `win_of`: the idle windows' records, as trim read them.
local function by_room_per_cost(snap, r, idle, win_of)
  -- read here, not in snapshot(): only a trim that revokes needs it, and snapshot() runs on
  -- every call
  local pst = num(redis.call("HGET", K.snapshot, "prefill_s_per_token"), -1)
  if pst < 0 then return idle end
  local tot = redis.call("HMGET", K.totals, "wait_granted", "wait_ms_sum")
  local granted = num(tot[1], 0)
  local wait_ms = 1
  if granted > 0 then wait_ms = math.max(1, num(tot[2], 0) / granted) end
  local lost = r - snap.capacity
  local t, cost, rank, cum = {}, {}, {}, 0
  for i, s in ipairs(idle) do
    local win = win_of[s]
    t[s], rank[s] = win and win.t or 0, i
    cum = cum + t[s]
    cost[s] = wait_ms
    if cum > lost then cost[s] = wait_ms + pst * 1000 * t[s] end
  end
  table.sort(idle, function(a, b)
    local ra, rb = t[a] / cost[a], t[b] / cost[b]
    if ra ~= rb then return ra > rb end
    return rank[a] < rank[b]
  end)
  return idle
end

-- the ledger is over-committed (windows grew past the ceiling): revoke windows, bounded.
-- Idle windows go first, in by_room_per_cost's order. Then windows a running turn holds, the
-- youngest first; those end at their lease's release. The oldest window always stays.
local function trim(snap, limit)
  if P.admission ~= 1 or P.residency ~= 1 or not snap.fresh then return 0 end
  -- hysteresis: windows may grow past the ceiling (rules 5 and 7); only when they outgrow
  -- the budget's share of the engines' whole capacity (ceiling / headroom) are windows
  -- revoked, down to the ceiling (the measured scale is 1 or more; the budget_scale override
  -- may set less: docs/budget.md)
  local r = reserved()
  if r <= snap.capacity * snap.scale then return 0 end
  local excess = r - snap.ceiling
  local n = 0
  local oldest = redis.call("ZRANGE", K.window_order, 0, 0)[1]
  -- window_exp holds idle windows only, scored by grace expiry: the earliest was released first.
  -- Each is read once, here (false: the oldest, which always stays, or none)
  local idle = redis.call("ZRANGE", K.window_exp, 0, limit - 1)
  local win_of = {}
  for _, s in ipairs(idle) do win_of[s] = s ~= oldest and jget(K.windows, s) or false end
  local order = by_room_per_cost(snap, r, idle, win_of)
  for _, s in ipairs(redis.call("ZREVRANGE", K.window_order, 0, limit - 1)) do
    order[#order + 1] = s
  end
  for _, s in ipairs(order) do
    if excess <= 0 then break end
    -- the oldest window always stays: revoking the last session cannot make room for anyone
    -- (an idle window is listed twice; once ended, its second listing finds nothing)
    local win = nil
    if s ~= oldest then
      win = win_of[s]
      if win == nil then win = jget(K.windows, s) end
    end
    if win and win.h == 0 then
      end_window(s, win)
      win_of[s] = false
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

-- bounded end of idle windows whose grace expired; returns how many
local function reap_windows(limit)
  return reap_expired(K.window_exp, limit, function(s)
    local win = jget(K.windows, s)
    if not (win and win.h == 0 and win.x <= NOW) then return false end
    end_window(s, win)
    stat("window_expired")
    return true
  end)
end
