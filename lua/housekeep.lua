--[[
  housekeep.lua: bounded maintenance, run by the poller every tick and by anyone who
  wants it: reclaims expired leases (TTL), ends expired idle windows, drops dead waiters,
  trims an over-committed ledger (idle windows longest idle first), then advances the FIFO.

  KEYS: the 14 gate keys (includes/common.lua).
  ARGV[1] now ms or ""; ARGV[2] JSON: limit (max items of each kind), plus the knobs of
    release.lua.
  Returns JSON {leases=n, windows=n, waiters=n, revoked=n, granted=n}
  Publishes "g <ticket>" for each FIFO head granted.
]]
--@include common
--@include snapshot
--@include windows
--@include leases
--@include waiters
account()

local n = reap(P.limit)
local snap = snapshot()
n.revoked = trim(snap, P.limit)
n.granted = advance(P.limit, snap)
return cjson.encode(n)
