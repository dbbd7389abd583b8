--[[
  cancel.lua: the caller gave up on an attempt (asyncio cancel, timeout, abort event).
  Atomically removes its waiter, or releases the lease granted to it concurrently, so a
  cancel racing a grant never leaks a reservation.

  KEYS: the 14 gate keys (includes/common.lua).
  ARGV[1] now ms or ""; ARGV[2] JSON: ticket (str), degraded (0/1: the caller's own clock
    gave up on the wait although the scripts' clock did not age it, a clock fault; counted as
    a degraded bypass, not a cancel), plus the knobs of release.lua.
  Returns JSON {removed="waiter"|"lease"|"none"}
  Publishes "g <ticket>" for each FIFO head granted after the removal.
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
return cjson.encode({ removed = removed })
