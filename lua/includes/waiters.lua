--[[
  waiters.lua: the global FIFO and its waiter records (fifo, waiters, alive, session_waiter):
  when a wait began, dropping a record, the reap of dead waiters, the bounded reap of all
  three records (leases, windows, waiters), and the FIFO advance that grants the heads that
  fit, oldest first. The record's fields: docs/keys.md#waiter; its states:
  docs/state-machines.md#waiter.

  KEYS used: fifo, waiters, alive, session_waiter, preempted, lease_exp, window_exp (the
    earliest deadline left after a reap)
  Knobs read: none (the fit test and the grant read theirs: snapshot.lua, windows.lua,
    leases.lua)
]]
--@include common
--@include snapshot
--@include windows
--@include leases

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

-- drop a waiter record past its liveness deadline: its process died or gave up without a
-- cancel. One still waiting is counted dead, and nobody will finish its session: the
-- session's preemption count (kept until finish_session) goes with it, or it would stay in
-- preempted for ever
local function drop_dead_waiter(ticket, w)
  drop_waiter(ticket, w)  -- also out of alive, with or without a record
  if w and w.st == "w" then
    stat("dead_waiter")
    redis.call("HDEL", K.preempted, w.s)
  end
end

-- bounded drop of waiter records past their liveness deadline; returns how many
local function reap_waiters(limit)
  return reap_expired(K.alive, limit, function(t)
    drop_dead_waiter(t, jget(K.waiters, t))
    return true
  end)
end

-- bounded reclaim of all three (leases, then idle windows, then dead waiters), at most
-- `limit` of each, when one of their deadlines has passed (common.lua deadline; `always`:
-- whatever the ledger's due_ms says, as the poller's housekeep does every tick); then the
-- earliest deadline left is the next due_ms
local function reap(limit, always)
  local n = { leases = 0, windows = 0, waiters = 0 }
  if limit <= 0 or not (always or reap_due()) then return n end
  n.leases = reap_leases(limit)
  n.windows = reap_windows(limit)
  n.waiters = reap_waiters(limit)
  local due = nil
  for _, zset in ipairs({ K.lease_exp, K.window_exp, K.alive }) do
    local first = tonumber(redis.call("ZRANGE", zset, 0, 0, "WITHSCORES")[2])
    if first ~= nil and (due == nil or first < due) then due = first end
  end
  lset("due_ms", due and I(due) or "none")
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
      drop_dead_waiter(head, w)
    else
      local win_mode = opens_window(w.r, snap.usage) and "open" or nil
      -- a sibling of a session whose shared prefixes are charged costs only its own part: the
      -- siblings that wait right behind a group's head fit with it, and enter together
      local pre = waiter_prefixes(w)
      if block_reason(snap, cost(w.n, pre)) ~= nil then break end
      drop_waiter(head, w)
      grant(head, w.s, w.n, w.p, w.v or 0, "open", w.e, win_mode, true, pre)
      publish("g " .. head, w.ch)
      granted = granted + 1
    end
  end
  return granted
end
