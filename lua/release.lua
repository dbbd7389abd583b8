--[[
  release.lua: an admitted turn is done; give back its lease (idempotent per ticket).
  A lease held under an ownership window turns the window idle for idle_grace (still
  charged; a window revoked while held ends instead); any other lease returns its tokens to
  the ledger. Then an over-committed ledger is trimmed (idle windows longest idle first) and the
  FIFO advances.

  KEYS: the 14 gate keys (includes/common.lua).
  ARGV[1] now ms or ""; ARGV[2] JSON:
    ticket (str), lat_ms (float, turn latency for the per-turn-index signal, optional),
    turn (int turn index, optional), plus the knobs adm, res, hw, pt, headroom, stale_ms,
    ttl_ms, grace_ms, claim_ms, reap, ch.
  Returns JSON {released=0|1, granted=<FIFO grants made>}
  Publishes "g <ticket>" for each FIFO head granted.
]]
--@include common
--@include snapshot
--@include windows
--@include leases
--@include waiters
account()

local l = free_lease(P.ticket)
if l and OPT.latency_ms ~= nil and OPT.turn_index ~= nil then
  local b = math.min(math.floor(num(OPT.turn_index, 0)), 63)
  statf("lat_s_sum:" .. b, num(OPT.latency_ms, 0) / 1000.0)
  stat("lat_n:" .. b)
end
reap(P.reap_batch)
local snap = snapshot()
trim(snap, P.reap_batch)
local g = advance(P.reap_batch, snap)
return cjson.encode({ released = l and 1 or 0, granted = g })
