--[[
  leases.lua: the lease record (leases, lease_exp): grant (charged to the ledger, or to the
  session's window it opens or joins), free (a window turns idle, or the lease's own charge
  goes back), and the reap of expired ones. The record's fields: docs/keys.md#lease; its
  states: docs/state-machines.md#lease.

  A holder's charge is its need less the parts its shared prefixes carry (prefixes.lua): a
  lease charged on its own holds its turn's prefixes, a lease under a window leaves them to
  the window.

  KEYS used: leases, lease_exp, windows, window_exp, window_order, preempted (the ledger
    through common.lua lget, lincr)
  Knobs read: lease_ttl_ms, claim_ms (grant)
]]
--@include common
--@include windows
--@include prefixes

-- remove a lease and give back what it holds; returns the lease or nil
local function free_lease(ticket)
  local l = jget(K.leases, ticket)
  if not l then return nil end
  redis.call("HDEL", K.leases, ticket)
  redis.call("ZREM", K.lease_exp, ticket)
  lincr("n_released", 1)
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
  drop_share(l)
  return l
end

-- open a lease for a turn of `need` tokens, `prompt` of them its prompt, `prev` the prompt of
-- the session's last turn (0: none known), `pre` the prefixes it shares (levels, as
-- prefixes.lua describes them; nil: none); with `win_mode` the charge goes to the session's
-- window:
--   "join"  the session owns a window: hold it (first holder re-sizes its charge)
--   "open"  open (or keep) the window for this session (admitted under pressure)
-- `known` is the session's window when the caller has just read it (rule 5's live window),
-- so that a turn reads its window once; nil: read here
local function grant(ticket, session, need, prompt, prev, reason, enq_ms, win_mode, claim, pre, known)
  local l = { s = session, t = 0, w = 0, a = NOW, e = enq_ms or NOW, r = reason, ep = epoch(), c = 0 }
  local win = known
  if win == nil and win_mode ~= nil then win = jget(K.windows, session) end
  -- what the engines should still hold of this prompt (the budget controller's re-prefill
  -- estimate, docs/budget.md#the-signals): the session's last prompt, when this one extends it
  -- and the gate has kept it charged since (its window; a gate without windows keeps nothing,
  -- and counts the last prompt whenever this one extends it), or the shared prefixes other
  -- holders keep charged. The rest is new to them: a session whose window the gate ended
  -- (the trim revoked it, its grace expired) comes back to a prefill the gate chose, so the
  -- controller reads as re-prefill only what the engines lost of what the gate held
  local reuse = 0
  if prev > 0 and prompt >= prev and (win_mode == nil or win ~= nil) then reuse = prev end
  reuse = math.max(reuse, math.min(need - cost(need, pre), prompt))
  lincr("tok_reusable", reuse)
  lincr("tok_fresh", prompt - reuse)
  if win_mode ~= nil then
    if win == nil then
      win = { t = 0, h = 1, ep = epoch(), x = 0, id = lincr("wseq", 1) }
      redis.call("ZADD", K.window_order, I(win.id), session)
      take_share(win, pre, need)
      charge(win.t)
      l.w = 1
    elseif win.h == 0 then
      -- the charge follows the session's latest turn both ways (a reset context shrinks it)
      local before = win.t
      take_share(win, pre, need)
      charge(win.t - before)
      win.h = 1
      win.x = 0
      redis.call("ZREM", K.window_exp, session)
      l.w = 1
    else
      -- a concurrent turn of the same session (a branch): charged on its own
      take_share(l, pre, need)
      charge(l.t)
    end
    if l.w == 1 then
      l.wid = win.id
      jset(K.windows, session, win)
    end
  else
    take_share(l, pre, need)
    charge(l.t)
  end
  local exp = NOW + P.lease_ttl_ms
  if claim then
    l.c = 1
    exp = NOW + math.min(P.claim_ms, P.lease_ttl_ms)
  end
  jset(K.leases, ticket, l)
  deadline(K.lease_exp, exp, ticket)
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

-- bounded reclaim of expired leases (their holders died, or a FIFO grant went unclaimed);
-- returns how many
local function reap_leases(limit)
  return reap_expired(K.lease_exp, limit, function(t)
    local l = free_lease(t)
    if not l then return false end
    stat("lease_expired")
    -- its holder is gone, and nobody will finish its session: its preemption count (kept
    -- until finish_session) goes with it, or it would stay in preempted for ever
    redis.call("HDEL", K.preempted, l.s)
    return true
  end)
end
