--[[
  cancel.lua: the caller gave up on an attempt (asyncio cancel, timeout, abort event).
  Atomically removes its waiter, or releases the lease granted to it concurrently, so a
  cancel racing a grant never leaks a reservation; then the FIFO advances.

  KEYS used: ledger, snapshot, fifo, waiters, alive, session_waiter, leases, lease_exp, windows,
    window_exp, totals, window_order, preempted, prefixes
  ARGV[1] now: the clock in ms, or "" for the Redis server clock (TIME)
  ARGV[2] JSON object of named parameters:
    ticket (str, required): the attempt given up
    degraded (0/1, optional): 1: the caller's own clock gave up on the wait although the
      scripts' clock did not age it (a clock fault): counted as a degraded bypass, not a
      cancel; absent: a cancel
  ARGV[3] knobs (includes/common.lua): admission, residency, high_watermark,
    pressure_threshold, headroom, budget_scale, staleness_ms, lease_ttl_ms, claim_ms,
    idle_grace_ms, reap_batch, channel
  Returns: JSON {removed="waiter"|"lease"|"none", srv=the Redis process's run_id (common.lua server_id)}
  Publishes: "g <ticket>" for each FIFO head granted after the removal.
  Errors: a required parameter that is missing (includes/common.lua).
]]
--@include common
--@include snapshot
--@include windows
--@include leases
--@include waiters
account()

local removed = "none"
local w = jget(K.waiters, P.ticket)
if w then
  drop_waiter(P.ticket, w)
  if w.st == "w" then
    removed = "waiter"
    if OPT.degraded == 1 then
      stat("bypass"); stat("bypass_degraded")
    else
      stat("cancelled")
    end
  end
end
if free_lease(P.ticket) then
  removed = "lease"
  stat("cancelled")
end
advance(P.reap_batch, nil)
return cjson.encode({ removed = removed, srv = server_id() })
