--[[
  release.lua: an admitted turn is done; give back its lease (idempotent per ticket).
  A lease held under an ownership window turns the window idle for the idle grace (still
  charged; a window revoked while held ends instead); any other lease returns its tokens to
  the ledger. A waiter record of the ticket is dropped too: one exists only when Redis lost
  the write that admitted it (a failover to a replica that had not replicated it yet), and
  the turn it stood for has run. Then a bounded reap, the trim of an over-committed ledger (idle windows longest
  idle first), and the FIFO advances.

  KEYS used: ledger, snapshot, fifo, waiters, alive, session_waiter, leases, lease_exp, windows,
    window_exp, totals, window_order, preempted, prefixes
  ARGV[1] now: the clock in ms, or "" for the Redis server clock (TIME)
  ARGV[2] JSON object of named parameters:
    ticket (str, required): the attempt whose lease is given back
    latency_ms (ms, optional): the turn's latency, for the per-turn-index signal
      (totals lat_us_sum:<turn>, in whole microseconds, and lat_n:<turn>); recorded only
      with turn_index
    turn_index (int, optional): the turn's index in its session (indices past 63 count as 63)
  ARGV[3] knobs (includes/common.lua): admission, residency, high_watermark,
    pressure_threshold, headroom, budget_scale, staleness_ms, lease_ttl_ms, claim_ms,
    idle_grace_ms, reap_batch, channel
  Returns: JSON {released=0|1, granted=<FIFO grants made>, srv=the Redis process's run_id (common.lua server_id)}
  Publishes: "g <ticket>" for each FIFO head granted.
  Errors: a required parameter that is missing (includes/common.lua).
]]
--@include common
--@include snapshot
--@include windows
--@include leases
--@include waiters
account()

local l = free_lease(P.ticket)
-- a ticket holds a lease or a waiter record, never both (every script that grants one drops
-- the other in the same call), so only a release that found no lease looks for the record
if not l then
  local w = jget(K.waiters, P.ticket)
  if w then drop_waiter(P.ticket, w) end
end
if l and OPT.latency_ms ~= nil and OPT.turn_index ~= nil then
  local b = math.min(math.floor(num(OPT.turn_index, 0)), 63)
  -- whole microseconds: HINCRBY (HINCRBYFLOAT costs Redis several times more, every turn)
  stat("lat_us_sum:" .. b, num(OPT.latency_ms, 0) * 1000)
  stat("lat_n:" .. b)
end
reap(P.reap_batch)
local snap = snapshot()
trim(snap, P.reap_batch)
local g = advance(P.reap_batch, snap)
return cjson.encode({ released = l and 1 or 0, granted = g, srv = server_id() })
