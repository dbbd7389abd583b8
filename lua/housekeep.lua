--[[
  housekeep.lua: bounded maintenance, run by the poller every tick and by anyone who
  wants it: reclaims expired leases (TTL), ends expired idle windows, drops dead waiters,
  then advances the FIFO.

  KEYS: the 13 gate keys (includes/common.lua).
  ARGV[1] now ms or ""; ARGV[2] JSON: limit (max items of each kind), plus the knobs of
    release.lua.
  Returns JSON {leases=n, windows=n, waiters=n, granted=n}
  Publishes "g <ticket>" for each FIFO head granted.
]]
--@include common
--@include state

local n = reap(math.floor(num(P.limit, 100)))
n.granted = advance(math.floor(num(P.limit, 100)), nil)
return cjson.encode(n)
