--[[
  housekeep.lua: bounded maintenance, run by the poller every tick and by anyone who wants
  it: reclaims expired leases (TTL), ends expired idle windows, drops dead waiters, trims an
  over-committed ledger (idle windows first, by room per cost), then advances the FIFO.

  KEYS used: ledger, snapshot, fifo, waiters, alive, session_waiter, leases, lease_exp, windows,
    window_exp, totals, window_order, preempted, prefixes
  ARGV[1] now: the clock in ms, or "" for the Redis server clock (TIME)
  ARGV[2] JSON object of named parameters:
    limit (count, required): the most items of each kind this call handles (in place of
      reap_batch)
  ARGV[3] knobs (includes/common.lua): admission, residency, high_watermark,
    pressure_threshold, headroom, budget_scale, staleness_ms, lease_ttl_ms, claim_ms,
    idle_grace_ms, channel
  Returns: JSON {leases=n, windows=n, waiters=n, revoked=n, granted=n}
  Publishes: "g <ticket>" for each FIFO head granted.
  Errors: a required parameter that is missing (includes/common.lua).
]]
--@include common
--@include snapshot
--@include windows
--@include leases
--@include waiters
account()

local n = reap(P.limit, true)
local snap = snapshot()
n.revoked = trim(snap, P.limit)
n.granted = advance(P.limit, snap)
return cjson.encode(n)
