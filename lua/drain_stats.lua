--[[
  drain_stats.lua: read and reset the step window of counters (one rollout step), together
  with the ledger's current state, atomically.

  KEYS used: ledger, snapshot, fifo, lease_exp, windows, stats, totals, preempted, prefixes
  ARGV[1] now: the clock in ms, or "" for the Redis server clock (TIME)
  ARGV[2] JSON object of named parameters:
    drain (0/1, required): 1: reset the step window; 0: a peek
  ARGV[3] knobs (includes/common.lua): staleness_ms, budget_scale, headroom (the ceiling,
    computed as acquire.lua does)
  Returns: JSON {stats={field=value...}, reserved, epoch, leases, waiting, windows,
    capacity, ceiling (tokens), budget_scale (the scale in use), usage, hit_rate,
    snapshot_age_ms (-1 when none), n_healthy, now, prefill_s_per_token, prefill_load
    (-1 when not measured), tool_gap_s (the typical time sessions spend between turns; -1
    before 8 samples), preempted_sessions, preempted_max (sessions with preempted attempts,
    and the most one of them has; over at most 1,024 sessions, sampled beyond), prefixes
    (shared prefixes charged now), psaved (tokens the ledger would hold beyond reserved if
    every holder were charged its shared prefix too)}
  Publishes: nothing.
  Errors: a required parameter that is missing (includes/common.lua).
]]
--@include common
--@include snapshot

-- the step's counters: the totals less what they were when the step began (stats); a
-- counter that went back (its totals lost) counts from zero
local flat = redis.call("HGETALL", K.totals)
local base = {}
local bflat = redis.call("HGETALL", K.stats)
for i = 1, #bflat, 2 do base[bflat[i]] = tonumber(bflat[i + 1]) end
local st = {}
for i = 1, #flat, 2 do
  local total = tonumber(flat[i + 1]) or 0
  local d = total - (base[flat[i]] or 0)
  if d < 0 then d = total end
  if d ~= 0 then st[flat[i]] = (d == math.floor(d)) and I(d) or tostring(d) end
end
if num(lget("usage_max"), -1) >= 0 then st.usage_max = lget("usage_max") end
if P.drain == 1 then
  redis.call("DEL", K.stats)
  if #flat > 0 then redis.call("HSET", K.stats, unpack(flat)) end
  lset("usage_max", "-1")
end
local v = redis.call("HMGET", K.snapshot, "ts_ms", "capacity", "usage", "hit_rate", "n_healthy",
  "prefill_s_per_token", "prefill_load")
local gap = tool_gap_s() or -1
local age = -1
if v[1] then age = NOW - tonumber(v[1]) end
-- the most preempted attempts of one live session: over every session up to 1,024 of them,
-- else over a random sample of 1,024 (sessions nobody finishes stay in the hash: the work of
-- a metrics read must stay bounded)
local pn = redis.call("HLEN", K.preempted)
local pvals
if pn <= 1024 then
  pvals = redis.call("HVALS", K.preempted)
else
  pvals = {}
  local flat = redis.call("HRANDFIELD", K.preempted, 1024, "WITHVALUES")
  for i = 2, #flat, 2 do pvals[#pvals + 1] = flat[i] end
end
local pmax = 0
for _, n in ipairs(pvals) do
  local x = tonumber(n) or 0
  if x > pmax then pmax = x end
end
local snap = snapshot()
return cjson.encode({
  stats = st, reserved = reserved(), epoch = epoch(), ceiling = snap.ceiling, budget_scale = snap.scale,
  leases = redis.call("ZCARD", K.lease_exp), waiting = redis.call("ZCARD", K.fifo),
  windows = redis.call("HLEN", K.windows), capacity = num(v[2], 0), usage = num(v[3], 0),
  hit_rate = num(v[4], -1), snapshot_age_ms = age, n_healthy = num(v[5], 0), now = NOW,
  prefill_s_per_token = num(v[6], -1), prefill_load = num(v[7], -1), tool_gap_s = gap,
  preempted_sessions = pn, preempted_max = pmax,
  prefixes = redis.call("HLEN", K.prefixes), psaved = num(lget("psaved"), 0),
})
