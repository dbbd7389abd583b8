--[[
  acquire.lua: decide one attempt (ticket) of one turn: rules 2-9 of the decision table
  (rule 1, pass-through, is the client's). Called for a new attempt and again for every
  re-check of a waiting one; reads top-down as the table: rule 4 first (a held lease), then
  attempt preemption, rules 2, 3, 5, 6, 7, 8 and 9 (aging, probing, waiting).

  KEYS used: ledger, snapshot, fifo, waiters, alive, session_waiter, leases, lease_exp,
    windows, window_exp, totals, preempted, window_order, prefixes
  ARGV[1] now: the clock in ms, or "" for the Redis server clock (TIME)
  ARGV[2] JSON object of named parameters:
    ticket (str, required): this attempt's id (a retry of a turn is a new ticket)
    session (str, required): the session (agent program) the turn belongs to
    need (tokens, required): what the turn reserves: its prompt plus its capped decode budget
    prompt (tokens, required): the prompt part of need
    prefixes (list, optional): the prefixes this turn's prompt shares with other sessions'
      (a system prompt, a GRPO task's prompt), outermost first, as [key, tokens] pairs: the
      key names the prefix, tokens is how many leading tokens of the prompt it is (so they
      grow level by level); each is charged to the ledger once while any holder of it is
      (includes/prefixes.lua); absent: nothing shared
    protected (0/1, required): 1: protected work, bypasses at once (rule 2)
    retain (0/1, required): 1: an admission opens (or keeps) the session's ownership window
      where the features say so (windows.lua opens_window)
    probe (ratio, required): the residency probe's answer: a hit ratio 0..1; -1 not probed
      yet (the script may answer "probe"); -2 no probe configured, or it failed
    prev_prompt (tokens, optional): the prompt of the session's last turn as this client saw
      it, for the re-prefill estimate (tok_fresh, tok_reusable); absent: none known
    gap (ms, optional): the session's time away since its last turn ended, sent once per
      attempt; feeds the typical tool gap (ledger lgap, ngap)
    t0 (ms, optional): when this attempt began, sent back from a "probe" reply's b: the
      attempt's age and its place among its session's attempts count from it
    age (1, optional): the caller's clock says this attempt waited max_wait_hard_s: age it now
    ch (str, optional): the pub/sub channel the caller's gate object listens on besides the
      gate's (kvgate.keys.listener_channel): this attempt's grant and preemption are published
      there if it waits; absent: on the gate's channel
  ARGV[3] knobs (includes/common.lua): admission, residency, high_watermark,
    pressure_threshold, hit_threshold, headroom, budget_scale, staleness_ms, lease_ttl_ms,
    claim_ms, idle_grace_ms, alive_ms, max_wait_ms, max_wait_hard_ms, reap_batch, channel
  Returns: JSON {o=outcome, r=reason, ep=epoch, srv=the Redis process's run_id (common.lua server_id), w=waited ms, t=charged tokens, held=1 (rule 4),
    pos=FIFO position (wait), b=when a new attempt began (probe: send it back as t0)}
    o = "admit" | "bypass" | "wait" | "probe" (not enqueued: probe, then call again with the
    answer) | "preempted" (r "preempted" or "session_finished"); an aged head is admitted with
    a lease, reason "aged"
  Publishes: "p <ticket>" when it preempts an older waiting attempt of the same session (an
    attempt that began before the waiting one is preempted itself instead), "g <ticket>" for
    FIFO heads granted by the bounded advance; each on the channel the waiter's record names
    (ch), else on the gate's.
  Errors: a required parameter that is missing (includes/common.lua).
]]
--@include common
--@include snapshot
--@include windows
--@include leases
--@include waiters

local ticket, session, need, prompt = P.ticket, P.session, math.floor(P.need), math.floor(P.prompt)
local prev = math.floor(num(OPT.prev_prompt, 0))
-- the prefixes it shares, as levels {k = key, t = the tokens it adds to the level before},
-- within its prompt, or nil: every fit test below reads its marginal cost
-- (includes/prefixes.lua cost), read where it is used, as the reaps on the way may end a
-- prefix's last other holder
local pre = nil
local below = 0
for _, lv in ipairs(OPT.prefixes or {}) do
  local upto = math.min(math.floor(num(lv[2], 0)), prompt)
  if upto > below then
    pre = pre or {}
    pre[#pre + 1] = { k = tostring(lv[1]), t = upto - below }
    below = upto
  end
end
account()

-- a new attempt may report how long its session was away since its last turn (the typical
-- tool gap, which kvgate status shows)
local gap = tonumber(OPT.gap)
if gap ~= nil and gap >= 0 then note_gap(gap) end

-- the FIFO place of a superseded attempt passes to the attempt that superseded it only while
-- that attempt is undecided (across its probe round trip); any decision consumes it
local inherited = nil

local function out(o, r, extra)
  -- something this call reaped or ended gave room back (SPEC 4: every purge wakes waiters):
  -- grant the heads that fit now, whatever this attempt's own answer
  if FREED then advance(P.reap_batch, nil) end
  if inherited ~= nil and o ~= "probe" then
    local ow = jget(K.waiters, inherited)
    if ow and ow.q then
      ow.q = nil
      jset(K.waiters, inherited, ow)
    end
    inherited = nil
  end
  local res = { o = o, r = r, ep = epoch(), srv = server_id() }
  if extra then for k, v in pairs(extra) do res[k] = v end end
  return cjson.encode(res)
end

-- rule 4 first: a ticket that holds a lease gets the same lease, charged once (this also
-- claims a lease granted to it from the FIFO while it waited)
local l = jget(K.leases, ticket)
if l then
  if l.c == 1 then
    l.c = 0
    jset(K.leases, ticket, l)
    deadline(K.lease_exp, NOW + P.lease_ttl_ms, ticket)
  end
  return out("admit", l.r, { w = l.a - l.e, t = l.t + 0, held = 1 })
end

local w = jget(K.waiters, ticket)
if w and w.st ~= "w" then
  -- a record that holds its FIFO place (q) for the newer attempt stays until that attempt
  -- takes the place (it may be away probing now) or the liveness reap drops it
  if not w.q then drop_waiter(ticket, w) end
  return out("preempted", w.st == "f" and "session_finished" or "preempted")
end

-- bounded reclaim, after this ticket's own lease was looked up: a grant still in the hash is
-- claimable by its ticket even at its claim deadline
reap(P.reap_batch)
if w and not jget(K.waiters, ticket) then w = nil end

-- a new attempt preempts the older waiting attempt of its session and takes its place; this
-- comes before rules 2 and 3, so a protected or degraded retry also ends the stale attempt
-- (its bypass then consumes the place it inherited, see out())
local seq = nil
if not w then
  local old = redis.call("HGET", K.session_waiter, session)
  if old and old ~= ticket then
    local ow = jget(K.waiters, old)
    if ow and ow.st == "w" and OPT.t0 ~= nil and num(ow.b or ow.e, 0) >= num(OPT.t0, 0) then
      -- this attempt was away probing while a newer attempt of its session enqueued (any
      -- waiter older than this attempt's first call was preempted by that call; one that
      -- began in the same ms counts as newer): it keeps its place, and this one is preempted
      redis.call("HINCRBY", K.preempted, session, 1)
      stat("preempted")
      return out("preempted", "preempted")
    end
    if ow and ow.st == "w" then
      ow.q = tonumber(redis.call("ZSCORE", K.fifo, old))
      redis.call("ZREM", K.fifo, old)
      ow.st = "p"
      jset(K.waiters, old, ow)
      redis.call("HINCRBY", K.preempted, session, 1)
      stat("preempted")
      publish("p " .. old, ow.ch)
    end
    -- inherit the superseded attempt's FIFO place (also after a probe round trip)
    if ow and ow.q then
      seq = ow.q
      inherited = old
    end
  end
end

-- rule 2: protected work never waits
if P.protected == 1 then
  if w then drop_waiter(ticket, w) end
  -- the FIFO lost this turn's record, or the stale attempt's place: the next head may fit now
  if w or inherited then advance(P.reap_batch, nil) end
  stat("bypass"); stat("bypass_protected")
  return out("bypass", "protected")
end

-- rule 3: no fresh snapshot (or no healthy engine) -> degraded bypass
local snap = snapshot()
if not snap.fresh then
  if w then drop_waiter(ticket, w) end
  stat("bypass"); stat("bypass_degraded")
  return out("bypass", "degraded")
end

-- does this turn open (or keep) an ownership window if it is admitted?
local opens = opens_window(P.retain, snap.usage)

-- (win: the session's window when this call has read it already, rule 5's)
local function admitted(reason, win_mode, win)
  local enq = nil
  if w then
    enq = w.e
    drop_waiter(ticket, w)
  end
  local g = grant(ticket, session, need, prompt, prev, reason, enq, win_mode, false, pre, win)
  trim(snap, P.reap_batch)
  advance(P.reap_batch, snap)
  return out("admit", reason, { w = g.a - g.e, t = g.t })
end

-- rule 5: the session owns a live ownership window
if P.residency == 1 then
  local win = live_window(session)
  if win then return admitted("reserved_session", "join", win) end
end

-- rule 6: nobody older waits and the turn fits every band of the features that are on
local older = false
if w then
  older = redis.call("ZRANGE", K.fifo, 0, 0)[1] ~= ticket
else
  older = redis.call("ZCARD", K.fifo) > 0
end
local blocked = block_reason(snap, cost(need, pre))
if not older and blocked == nil then
  return admitted("open", opens and "open" or nil)
end

-- rules 7 and 8 admit past the ledger (the prefix is resident, or nobody can tell); they
-- open a window only where the ledger has room for it, so an over-committed ledger does
-- not hand places to newcomers (it would only revoke someone else's)
local win_mode = nil
-- (with residency alone, only under pressure, as everywhere: opens_window)
if opens and (P.admission ~= 1 or reserved() + cost(need, pre) <= snap.ceiling) then win_mode = "open" end
local probe = P.probe
local band = P.residency == 1 and (P.admission ~= 1 or snap.usage < P.pressure_threshold)

if band then
  -- rule 7: the probe says this prompt's prefix is resident
  if probe >= 0 and probe >= P.hit_threshold and (P.admission ~= 1 or reserved() + cost(need, pre) <= snap.ceiling) then
    return admitted("resident_prefix", win_mode)
  end
  -- rule 8: residency alone fails open when no probe answers (with admission on, a failed
  -- probe falls through to the ledger's answer: wait)
  if P.admission ~= 1 and probe == -2 then
    return admitted("prefix_probe_unavailable", win_mode)
  end
end

-- rule 9: wait in the global FIFO. Aging is a liveness guard, not a latency budget (SPEC 4):
-- only the head leaves the FIFO by aging, when the gate made no progress for max_wait_s
-- (measured from when it began waiting, if later) or when it waited max_wait_hard_s; an aged
-- head is admitted like any other turn, with a lease, so the ledger keeps counting it.
-- (Ages count from the attempt's start, not the enqueue: the caller's own deadline does.)
local reason = blocked or "queued"
local since = w and waiter_since(w) or num(OPT.t0, NOW)
local function aged_out()
  if OPT.age == 1 then return true end  -- the caller's clock: past max_wait_hard_s
  -- the head: this waiter, or a new attempt back from its probe round trip that finds the
  -- FIFO empty (its stall counts from when it began, t0)
  if w then
    if redis.call("ZRANGE", K.fifo, 0, 0)[1] ~= ticket then return false end
  elseif OPT.t0 == nil or redis.call("ZCARD", K.fifo) > 0 then
    return false
  end
  if NOW - since >= P.max_wait_hard_ms then return true end
  return NOW - math.max(since, last_progress() or since) >= P.max_wait_ms
end
if aged_out() then
  if P.admission == 1 and P.residency == 1 then
    -- idle windows that have waited longest on their tools give way to it (docs/decisions.md)
    evict_idle(snap, cost(need, pre), P.reap_batch)
  end
  return admitted("aged", opens and "open" or nil)
end
if band and probe == -1 and (P.admission ~= 1 or reserved() + cost(need, pre) <= snap.ceiling) then
  -- rules 1-6 did not decide and a probe could: ask the caller to probe, then call again
  -- (with admission on, rule 7 needs room in the ledger: without it no answer could admit)
  -- a new attempt learns when it began (t0 on its next call), so that a newer attempt
  -- enqueued meanwhile is not mistaken for an older one
  return out("probe", reason, (not w) and { b = num(OPT.t0, NOW) } or nil)
end
if not w then
  if seq == nil then seq = lincr("seq", 1) end
  w = { s = session, n = need, p = prompt, v = prev, e = NOW, st = "w", r = P.retain, ch = OPT.ch }
  if pre ~= nil then w.pk, w.pt = prefix_fields(pre) end
  if OPT.t0 ~= nil then w.b = num(OPT.t0, NOW) end  -- began before enqueueing (a probe round trip)
  jset(K.waiters, ticket, w)
  redis.call("ZADD", K.fifo, I(seq), ticket)
  redis.call("HSET", K.session_waiter, session, ticket)
  stat("wait")
  stat("wait_" .. reason)
elseif w.n ~= need or w.p ~= prompt then
  w.n = need
  w.p = prompt
  w.pk, w.pt = nil, nil
  if pre ~= nil then w.pk, w.pt = prefix_fields(pre) end
  jset(K.waiters, ticket, w)
end
deadline(K.alive, NOW + P.alive_ms, ticket)
-- let heads that fit go first (bounded); this ticket may be one of them
advance(P.reap_batch, snap)
local g = jget(K.leases, ticket)
if g then
  g.c = 0
  jset(K.leases, ticket, g)
  deadline(K.lease_exp, NOW + P.lease_ttl_ms, ticket)
  return out("admit", g.r, { w = g.a - g.e, t = g.t })
end
return out("wait", reason, { w = NOW - waiter_since(w), pos = redis.call("ZRANK", K.fifo, ticket) })
