--[[
  common.lua: names, clock, argument decoding and small helpers shared by every script.

  Every kvgate script receives the same 14 KEYS (all under one hash tag, so a gate lives
  in one Redis Cluster slot):
    KEYS[1]  ledger        HASH   reserved (tokens), epoch, seq (FIFO sequence counter),
                                  wseq (window id counter), progress_ms (the gate's last
                                  progress), lgap (EWMA of log tool gap, s), ngap (gaps reported);
                                  what the budget controller reads (docs/budget.md): acc_ts,
                                  acc_wait_ms (time with turns waiting), acc_idle_ms (of that,
                                  time with no turn in flight), tok_fresh, tok_reusable (prompt
                                  tokens admitted, new to the engines / the session's last
                                  prompt, which they may still hold), n_released (leases ended)
    KEYS[2]  snapshot      HASH   ts_ms, capacity, usage, n_engines, n_healthy, healthy_sig,
                                  hit_rate, prefill_s_per_token, prefill_load, engines (JSON),
                                  budget_scale, budget_ts_ms (the poller's measured budget)
    KEYS[3]  fifo          ZSET   ticket -> FIFO sequence number (strict order)
    KEYS[4]  waiters       HASH   ticket -> JSON {s=session, n=need tokens, p=prompt tokens,
                                  v=prompt tokens of the session's last turn, e=enqueued ms,
                                  b=began ms (if before e), r=retain, q=FIFO place passed on,
                                  st="w" waiting | "p" preempted | "f" session finished}
    KEYS[5]  alive         ZSET   ticket -> liveness deadline (ms) of a waiter record
    KEYS[6]  session_waiter HASH  session -> its waiting ticket (attempt preemption)
    KEYS[7]  leases        HASH   ticket -> JSON {s, t=own charge (tokens), w=1 if held under
                                  the session's window, wid=that window's id, a=admitted ms,
                                  e=enqueued ms, r=reason,
                                  ep=epoch, c=1 while a FIFO grant is unclaimed}
    KEYS[8]  lease_exp     ZSET   ticket -> lease expiry (ms)
    KEYS[9]  windows       HASH   session -> JSON {id=window id, t=charged tokens, h=holders, ep=epoch,
                                  rv=1 when it is to end at its release (revoked while held),
                                  x=idle-grace expiry ms (0 while held)}
    KEYS[10] window_exp    ZSET   session -> idle-grace expiry (ms), idle windows only
    KEYS[11] stats         HASH   counters of the current rollout step (drained per step)
    KEYS[12] totals        HASH   the same counters, never drained (Prometheus)
    KEYS[13] preempted     HASH   session -> number of preempted attempts
    KEYS[14] window_order  ZSET   session -> its window's id (opening order: the oldest window
                                  is never revoked; held windows are revoked youngest first)
  ARGV[1] = now in ms, or "" to use the Redis server clock (TIME).
  ARGV[2] = JSON object of named parameters (each script's header lists its fields).
]]
local K = {
  ledger = KEYS[1], snapshot = KEYS[2], fifo = KEYS[3], waiters = KEYS[4], alive = KEYS[5],
  session_waiter = KEYS[6], leases = KEYS[7], lease_exp = KEYS[8], windows = KEYS[9],
  window_exp = KEYS[10], stats = KEYS[11], totals = KEYS[12], preempted = KEYS[13],
  window_order = KEYS[14],
}

local function now_ms()
  if ARGV[1] ~= nil and ARGV[1] ~= "" then
    return math.floor(tonumber(ARGV[1]))
  end
  local t = redis.call("TIME")
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local NOW = now_ms()
-- the parameters: OPT.<name> is nil when absent; a JSON null is an absent parameter (cjson
-- decodes it as a sentinel that is not nil)
local OPT = cjson.decode(ARGV[2] or "{}")
for k, v in pairs(OPT) do
  if v == cjson.null then OPT[k] = nil end
end
-- P.<name>: a required parameter; reading a missing one is an error naming it (level 2: the
-- error points at the line that read it)
local P = setmetatable({}, { __index = function(_, name)
  local v = OPT[name]
  if v == nil then
    error("kvgate: missing required parameter '" .. tostring(name) .. "' in ARGV[2]", 2)
  end
  return v
end })

-- integer to string, for HINCRBY / ZADD / HSET arguments (avoids "1.7e+12" forms)
local function I(n)
  return string.format("%d", math.floor(tonumber(n) or 0))
end

local function num(v, default)
  local n = tonumber(v)
  if n == nil then return default end
  return n
end

local function jget(key, field)
  local raw = redis.call("HGET", key, field)
  if not raw then return nil end
  return cjson.decode(raw)
end

local function jset(key, field, tbl)
  redis.call("HSET", key, field, cjson.encode(tbl))
end

-- count an event in the step window and in the cumulative totals
local function stat(field, by)
  by = by or 1
  redis.call("HINCRBY", K.stats, field, I(by))
  redis.call("HINCRBY", K.totals, field, I(by))
end

local function statf(field, by)
  redis.call("HINCRBYFLOAT", K.stats, field, tostring(by))
  redis.call("HINCRBYFLOAT", K.totals, field, tostring(by))
end

local function publish(msg)
  if P.channel ~= "" then
    redis.call("PUBLISH", P.channel, msg)
  end
end

local function reserved()
  return num(redis.call("HGET", K.ledger, "reserved"), 0)
end

-- change the ledger; it never goes below zero (a clamp is counted, it signals a bug)
-- set when this call gave tokens back to the ledger (a reap, a window ended): the FIFO head
-- may fit now, and acquire.lua's out() runs the bounded advance before it answers
local FREED = false

local function charge(delta)
  if delta == 0 then return end
  if delta < 0 then FREED = true end
  local r = reserved() + delta
  if r < 0 then
    stat("ledger_clamped")
    r = 0
  end
  redis.call("HSET", K.ledger, "reserved", I(r))
end

-- the gate made progress (SPEC 4): an admission other than by aging, a FIFO grant, a lease
-- released or reclaimed, a window ended. The FIFO head ages only after max_wait_s without any.
local function progress()
  redis.call("HSET", K.ledger, "progress_ms", I(NOW))
end

-- integrate the state that held since the last script call (only scripts change it) into the
-- time counters the budget controller reads: how long turns waited in the FIFO, and how much
-- of that time no turn of this gate was in flight (the engines had nothing of ours to do).
-- Called on entry by every script that changes leases or the FIFO.
local function account()
  local last = tonumber(redis.call("HGET", K.ledger, "acc_ts"))
  if last ~= nil and NOW <= last then return end
  if last ~= nil and redis.call("ZCARD", K.fifo) > 0 then
    redis.call("HINCRBY", K.ledger, "acc_wait_ms", I(NOW - last))
    if redis.call("ZCARD", K.lease_exp) == 0 then
      redis.call("HINCRBY", K.ledger, "acc_idle_ms", I(NOW - last))
    end
  end
  redis.call("HSET", K.ledger, "acc_ts", I(NOW))
end

-- when the gate last made progress (ms), or nil if it never did
local function last_progress()
  return tonumber(redis.call("HGET", K.ledger, "progress_ms"))
end

local function epoch()
  return num(redis.call("HGET", K.ledger, "epoch"), 0)
end

-- the typical tool gap: the geometric mean (an EWMA of the logarithm, so the heavy tail of
-- tool latencies does not drive it) of the seconds between a session's turns, as the clients
-- measure them (the end of its last turn to the start of this one). Stored in the ledger hash:
-- lgap (log seconds), ngap (samples). Nil until GAP_MIN_SAMPLES arrived.
local GAP_ALPHA, GAP_MIN_SAMPLES = 0.05, 8
local function note_gap(ms)
  local x = math.log(math.max(ms, 1) / 1000.0)
  local lg = tonumber(redis.call("HGET", K.ledger, "lgap"))
  if lg then x = lg + GAP_ALPHA * (x - lg) end
  redis.call("HSET", K.ledger, "lgap", tostring(x))
  redis.call("HINCRBY", K.ledger, "ngap", 1)
end
local function tool_gap_s()
  local v = redis.call("HMGET", K.ledger, "lgap", "ngap")
  if not v[1] or num(v[2], 0) < GAP_MIN_SAMPLES then return nil end
  return math.exp(tonumber(v[1]))
end
