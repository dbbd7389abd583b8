--[[
  snapshot.lua: the latest capacity snapshot as the rules read it (fresh, usage, capacity, the
  budget scale in use and the ceiling) and the fit test of rule 6 (block_reason). The poller
  writes the snapshot (write_snapshot.lua).

  KEYS used: snapshot
  Knobs read: staleness_ms, budget_scale, headroom (snapshot); admission, pressure_threshold,
    residency, high_watermark (block_reason)
]]
--@include common

-- the latest snapshot: fresh (bool), usage (0..1), capacity (tokens), nh (healthy engines),
-- scale (the budget scale in use) and ceiling (tokens: capacity x headroom x scale).
-- The budget scale is how far the held sessions may over-commit the pool (docs/budget.md):
-- the caller's fixed budget_scale when it sets one, else the one the poller's controller
-- measured, while that is fresher than staleness; else 1, the ledger of the seeds.
local function snapshot()
  local v = redis.call("HMGET", K.snapshot, "ts_ms", "usage", "capacity", "n_healthy",
    "budget_scale", "budget_ts_ms")
  local ts = tonumber(v[1])
  local s = { fresh = false, usage = num(v[2], 0), capacity = num(v[3], 0), ceiling = 0,
    nh = num(v[4], 0), scale = 1 }
  if ts ~= nil and s.nh > 0 and (NOW - ts) <= P.staleness_ms then
    s.fresh = true
  end
  if P.budget_scale > 0 then
    s.scale = P.budget_scale
  else
    local bts = tonumber(v[6])
    if bts ~= nil and (NOW - bts) <= P.staleness_ms and num(v[5], 0) > 0 then s.scale = tonumber(v[5]) end
  end
  s.ceiling = math.floor(s.capacity * P.headroom * s.scale)
  return s
end

-- why a turn that adds `need` tokens to the ledger (its marginal cost: prefixes.lua) may not
-- enter by rule 6 (nil: it fits). A turn larger than the
-- whole ceiling fits once nothing else is charged: else it could enter only by aging, and
-- while other turns flow aging waits for max_wait_hard_s
local function block_reason(snap, need)
  if P.admission == 1 then
    if snap.usage >= P.pressure_threshold then return "pressure_guard" end
    if reserved() + math.min(need, snap.ceiling) > snap.ceiling then return "capacity_exhausted" end
  end
  if P.residency == 1 and snap.usage >= P.high_watermark then return "cold_prefix" end
  return nil
end
