--[[
  write_snapshot.lua: store the engines' capacity snapshot atomically. Capacity is the sum
  of healthy engines' KV tokens, usage the worst healthy engine's KV usage. A change in the
  set of healthy engines bumps the epoch. Samples usage into the step's window
  (kv_token_usage mean and max), then trims and advances the FIFO (fresh usage may admit
  heads).

  KEYS used: ledger, snapshot, fifo, waiters, alive, session_waiter, leases, lease_exp, windows,
    window_exp, totals, window_order, preempted, prefixes
  ARGV[1] now: the clock in ms, or "" for the Redis server clock (TIME)
  ARGV[2] JSON object of named parameters:
    engines (JSON list, required): one entry per engine, stored as it is in the snapshot's
      engines field (its fields: docs/keys.md#engine); the snapshot's prefill_s_per_token
      is the slowest healthy engine's pst, its prefill_load the busiest one's pl (-1: none
      measured)
    measured_scale (factor, optional): the budget scale the poller's controller measured,
      stored with the time it was written; absent: the stored one is left as it is
  ARGV[3] knobs (includes/common.lua): admission, residency, high_watermark,
    pressure_threshold, headroom, budget_scale, staleness_ms, lease_ttl_ms, claim_ms,
    reap_batch, channel
  Returns: JSON {epoch=n, bumped=0|1, capacity=tokens, usage=float, n_healthy=n}
  Publishes: "e <epoch>" on a bump, "g <ticket>" for FIFO grants.
  Errors: a required parameter that is missing (includes/common.lua).
]]
--@include common
--@include snapshot
--@include windows
--@include leases
--@include waiters
account()

local cap, usage, nh, hit_sum, hit_n, pst, pl = 0, 0, 0, 0, 0, -1, -1
local ids = {}
for _, e in ipairs(P.engines) do
  if e.healthy == 1 then
    nh = nh + 1
    cap = cap + math.floor(num(e.cap, 0))
    usage = math.max(usage, num(e.usage, 0))
    table.insert(ids, tostring(e.id))
    if num(e.pst, -1) >= 0 then pst = math.max(pst, e.pst) end
    if num(e.pl, -1) >= 0 then pl = math.max(pl, e.pl) end
    if num(e.hit, -1) >= 0 then
      hit_sum = hit_sum + e.hit
      hit_n = hit_n + 1
    end
  end
end
table.sort(ids)
local sig = table.concat(ids, "\n")
local old = redis.call("HGET", K.snapshot, "healthy_sig")
local bumped = 0
if old == false or old ~= sig then
  if old ~= false then
    bumped = 1
    lincr("epoch", 1)
    stat("epoch_bumps")
    publish("e " .. I(epoch()))
  end
end
local hit = -1
if hit_n > 0 then hit = hit_sum / hit_n end
redis.call("HSET", K.snapshot, "ts_ms", I(NOW), "capacity", I(cap), "usage", tostring(usage),
  "n_engines", I(#P.engines), "n_healthy", I(nh), "healthy_sig", sig,
  "hit_rate", tostring(hit), "prefill_s_per_token", tostring(pst), "prefill_load", tostring(pl),
  "engines", cjson.encode(P.engines))
if OPT.measured_scale ~= nil then
  redis.call("HSET", K.snapshot, "budget_scale", tostring(OPT.measured_scale), "budget_ts_ms", I(NOW))
end
if nh > 0 then
  statf("usage_sum", usage)
  stat("usage_n")
  -- the step's highest usage (drain_stats.lua reports and resets it)
  if usage > num(lget("usage_max"), -1) then lset("usage_max", tostring(usage)) end
end
local snap = snapshot()
trim(snap, P.reap_batch)
advance(P.reap_batch, snap)
return cjson.encode({ epoch = epoch(), bumped = bumped, capacity = cap, usage = usage, n_healthy = nh })
