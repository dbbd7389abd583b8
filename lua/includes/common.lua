--[[
  common.lua: what every script shares: the gate's keys (K), the clock (NOW), the parameters
  (P, OPT), and small helpers: integers for Redis, JSON records in hashes, counters,
  publishing, the ledger's charge, the gate's progress, time accounting and the tool gap.

  Every script is passed all 15 gate keys in KEYS, in this order (kvgate.keys.SCRIPT_KEYS),
  all under the gate's {hash tag}, so a gate lives in one Redis Cluster slot; its header's
  KEYS used names the roles it touches. Their fields and the layout of the JSON records:
  docs/keys.md.
  Gate keys:
    ledger (HASH): reserved tokens, epoch, sequence counters, progress, budget accounting
    snapshot (HASH): the engines' latest capacity snapshot and the measured budget scale
    fifo (ZSET): waiting ticket -> FIFO sequence number (strict order)
    waiters (HASH): ticket -> waiter record
    alive (ZSET): ticket -> liveness deadline (ms) of its waiter record
    session_waiter (HASH): session -> its waiting ticket (attempt preemption)
    leases (HASH): ticket -> lease record
    lease_exp (ZSET): ticket -> lease expiry (ms): the TTL, or a FIFO grant's claim deadline
    windows (HASH): session -> ownership window record
    window_exp (ZSET): session -> idle-grace expiry (ms), idle windows only
    stats (HASH): the counters of totals as they stood when the current rollout step began
      (drain_stats.lua): the step's counters are totals less these
    totals (HASH): the counters, cumulative (Prometheus)
    preempted (HASH): session -> its preempted attempts (until finish_session)
    window_order (ZSET): session -> its window's id (opening order)
    prefixes (HASH): shared prefix key -> its record (charged once while held)

  ARGV[1] now: the clock in ms, or "" for the Redis server clock (TIME); tests and the
    simulator inject it.
  ARGV[2] a JSON object of named parameters: the call's own; each script's header lists
    those it reads.
  ARGV[3] (optional) a JSON object of the gate's knobs, the same text on every call of one
    gate object (kvgate/client/flows.py knob_params, from the defaults of kvgate/config.py).
    The function library decodes each distinct text once and keeps it (KNOBS_SEEN), so a
    turn's calls decode only their own parameters (docs/benchmarks.md, where the server time
    goes). A name in ARGV[2] wins over the same name in ARGV[3].
    P.<name> reads a required parameter or knob: absent from both (or JSON null) is a Lua
    error that names it, raised where it is read. OPT.<name> reads an optional parameter of
    ARGV[2]: nil when absent. No default lives in Lua.

  The knobs are sent with every call and required by every script that reads them; a
  script's header names the ones it reads in its ARGV[3] entry.
  Knobs:
    admission (0/1): the admission feature is on (ledger, pressure guard, strict FIFO)
    residency (0/1): the residency feature is on (ownership windows, prefix probes)
    high_watermark (usage 0..1): from this KV usage on, newcomers need a window or a
      resident prefix (residency)
    pressure_threshold (usage 0..1): from this KV usage on, only window owners enter
      (admission)
    hit_threshold (ratio 0..1): a probe's hit ratio from which rule 7 admits
    headroom (fraction, at most 1): the ceiling's share of the healthy engines' capacity
    budget_scale (factor): a fixed budget scale > 0, or -1 for the one the poller measured
      (kvgate/control/budget.py), while it is fresh
    staleness_ms (ms): a snapshot, or a measured budget scale, older than this is not used
    lease_ttl_ms (ms): a lease not released within this is reclaimed (its holder died)
    idle_grace_ms (ms): how long a released window stays, still charged, for its session's
      next turn
    claim_ms (ms): how long a FIFO grant waits for its waiter to claim it
    alive_ms (ms): how long a waiter record lives past each of its re-checks
    max_wait_ms (ms): the FIFO head ages after this long without progress of the gate
    max_wait_hard_ms (ms): the FIFO head ages after waiting this long, whatever the progress
    reap_batch (count): the most items of each kind one call reclaims, trims or grants
    channel (str): the pub/sub channel of grants, preemptions and epoch bumps ("": none)

  KEYS used: ledger, fifo, totals, lease_exp
  Knobs read: channel
]]
-- what one call works on, set by begin() at its start: the scripts are also loaded once as a
-- Redis function library (kvgate/client/scripts.py library_source), whose helpers outlive a
-- call, so nothing of one call may linger in them for the next
local K = {}  -- role -> key name
local KEY_ROLES = { "ledger", "snapshot", "fifo", "waiters", "alive", "session_waiter", "leases",
  "lease_exp", "windows", "window_exp", "stats", "totals", "preempted", "window_order", "prefixes" }
local NOW = 0
-- the parameters: OPT.<name> is nil when absent
local OPT = {}
-- the knobs of this call (ARGV[3], decoded), and every knobs text seen (text -> decoded):
-- a function library's tables outlive a call, so a gate's knobs are decoded once per server
-- process; a new text past KNOBS_MAX_SEEN starts the table afresh (a server that serves
-- many gate configurations keeps the latest ones, not all)
-- (NO_KNOBS: a call without ARGV[3]; nothing writes to the knobs, so one empty table serves)
local NO_KNOBS = {}
local KN = NO_KNOBS
local KNOBS_SEEN, KNOBS_N, KNOBS_MAX_SEEN = {}, 0, 64
-- the ledger hash, read whole once per call (HGETALL: a dozen small fields) and written back
-- once, by finish(): a turn reads and writes several of its fields (the reservation, the
-- clock of the time integrals, the epoch, the counters of the budget), each one more command
-- run from Lua and each write one more entry in the replication stream (docs/benchmarks.md,
-- where the server time goes). lget/lset/lincr are its only readers and writers in the
-- scripts.
local LEDGER, LEDGER_DIRTY = nil, {}
-- set when this call gave tokens back to the ledger (a reap, a window ended): the FIFO head
-- may fit now, and acquire.lua's out() runs the bounded advance before it answers
local FREED = false

-- ARGV[1]: the injected clock, or "" for the Redis server's
local function now_ms(clock)
  if clock ~= nil and clock ~= "" then
    return math.floor(tonumber(clock))
  end
  local t = redis.call("TIME")
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- P.<name>: a required parameter; reading a missing one is an error naming it (level 2: the
-- error points at the line that read it). Its metatable is set by begin(): a function
-- library's load may not call setmetatable, only its functions may
local P = {}
local P_META = { __index = function(_, name)
  local v = OPT[name]
  if v == nil then v = KN[name] end
  if v == nil then
    error("kvgate: missing required parameter '" .. tostring(name) .. "' in ARGV[2] or ARGV[3]", 2)
  end
  return v
end }

-- a decoded JSON object with its nulls made absent (cjson decodes null as a sentinel that is
-- not nil)
local function decode_params(text)
  local t = cjson.decode(text)
  for k, v in pairs(t) do
    if v == cjson.null then t[k] = nil end
  end
  return t
end

local function begin(keys, argv)
  setmetatable(P, P_META)
  for i, role in ipairs(KEY_ROLES) do K[role] = keys[i] end
  NOW = now_ms(argv[1])
  OPT = decode_params(argv[2] or "{}")
  local knobs = argv[3]
  if knobs == nil then
    KN = NO_KNOBS
  else
    KN = KNOBS_SEEN[knobs]
    if KN == nil then
      KN = decode_params(knobs)
      if KNOBS_N >= KNOBS_MAX_SEEN then KNOBS_SEEN, KNOBS_N = {}, 0 end
      KNOBS_SEEN[knobs], KNOBS_N = KN, KNOBS_N + 1
    end
  end
  LEDGER, LEDGER_DIRTY, FREED = nil, {}, false
end

-- integer to string, for HINCRBY / ZADD / HSET arguments (avoids "1.7e+12" forms)
local function I(n)
  return string.format("%d", math.floor(tonumber(n) or 0))
end

local function num(v, default)
  local n = tonumber(v)
  if n == nil then return default end
  return n
end

local function lget(field)
  if LEDGER == nil then
    LEDGER = {}
    local flat = redis.call("HGETALL", K.ledger)
    for i = 1, #flat, 2 do LEDGER[flat[i]] = flat[i + 1] end
  end
  return LEDGER[field]
end
local function lset(field, value)
  lget(field)
  LEDGER[field] = value
  LEDGER_DIRTY[field] = true
end
-- add `by` to an integer field of the ledger (HINCRBY's rule); returns the new value
local function lincr(field, by)
  local n = math.floor(tonumber(lget(field)) or 0) + math.floor(by)
  lset(field, string.format("%d", n))
  return n
end
-- what every script runs after its body, whether it returned or raised
-- (kvgate/client/scripts.py as_main): write back the ledger's changed fields in one HSET
local function finish()
  local args = {}
  for field in pairs(LEDGER_DIRTY) do
    args[#args + 1] = field
    args[#args + 1] = LEDGER[field]
  end
  if #args > 0 then redis.call("HSET", K.ledger, unpack(args)) end
end

-- one call of a script's body, `main` (kvgate/client/scripts.py): begin, the body, and
-- finish() on every exit: its answer, and an error raised midway too (a command Redis
-- refused), since Redis keeps whatever the body wrote before the error and the ledger must
-- agree with it. The error is then raised as it was (an error reply stays one).
local function run(keys, argv, main)
  begin(keys, argv)
  local ok, res = pcall(main)
  finish()
  if not ok then error(res, 0) end
  return res
end

local function jget(key, field)
  local raw = redis.call("HGET", key, field)
  if not raw then return nil end
  return cjson.decode(raw)
end

local function jset(key, field, tbl)
  redis.call("HSET", key, field, cjson.encode(tbl))
end

-- the members of sorted set `zset` whose deadline (score, ms) has passed, at most `limit`:
-- `ends(member)` ends the record behind each and says whether there was one to end; a member
-- with none is a stale entry and leaves the set. Returns how many records ended.
local function reap_expired(zset, limit, ends)
  local n = 0
  for _, m in ipairs(redis.call("ZRANGEBYSCORE", zset, "-inf", I(NOW), "LIMIT", 0, limit)) do
    if ends(m) then
      n = n + 1
    else
      redis.call("ZREM", zset, m)
    end
  end
  return n
end

-- the deadlines of leases (lease_exp), idle windows (window_exp) and waiters (alive) are all
-- set here, which keeps the ledger's due_ms at or before the earliest of them ("none": no
-- deadline is pending; absent: unknown), so that a call with nothing past its deadline skips
-- the reaps (waiters.lua reap): three commands of every call otherwise. A deadline moved
-- later leaves due_ms early, which costs one reap that finds nothing and reads it afresh.
local function deadline(zset, t, member)
  redis.call("ZADD", zset, I(t), member)
  local due = tonumber(lget("due_ms"))
  if due == nil or t < due then lset("due_ms", I(t)) end
end

local function reap_due()
  local due = lget("due_ms")
  if due == "none" then return false end
  due = tonumber(due)
  return due == nil or due <= NOW
end

-- count an event (the rollout step's window is the totals less their values when the step
-- began: drain_stats.lua, so an event is one command)
local function stat(field, by)
  redis.call("HINCRBY", K.totals, field, I(by or 1))
end

local function statf(field, by)
  redis.call("HINCRBYFLOAT", K.totals, field, tostring(by))
end

-- publish on the gate's channel, or on `ch`: the channel of the gate object a waiter
-- listens on (its record's ch), so that a grant or a preemption wakes that one process and not
-- every process of the gate ("" channel knob: no pub/sub at all)
local function publish(msg, ch)
  if P.channel ~= "" then
    redis.call("PUBLISH", ch or P.channel, msg)
  end
end

local function reserved()
  return num(lget("reserved"), 0)
end

-- change the ledger; it never goes below zero (a clamp is counted, it signals a bug)
local function charge(delta)
  if delta == 0 then return end
  if delta < 0 then FREED = true end
  local r = reserved() + delta
  if r < 0 then
    stat("ledger_clamped")
    r = 0
  end
  lset("reserved", I(r))
end

-- the gate made progress (SPEC 4): an admission other than by aging, a FIFO grant, a lease
-- released or reclaimed, a window ended. The FIFO head ages only after max_wait_s without any.
local function progress()
  lset("progress_ms", I(NOW))
end

-- integrate the state that held since the last script call (only scripts change it) into the
-- time counters the budget controller reads: how long turns waited in the FIFO, and how much
-- of that time no turn of this gate was in flight (the engines had nothing of ours to do).
-- Called on entry by every script that changes leases or the FIFO.
local function account()
  local last = tonumber(lget("acc_ts"))
  if last ~= nil and NOW <= last then return end
  if last ~= nil and redis.call("ZCARD", K.fifo) > 0 then
    lincr("acc_wait_ms", NOW - last)
    if redis.call("ZCARD", K.lease_exp) == 0 then
      lincr("acc_idle_ms", NOW - last)
    end
  end
  lset("acc_ts", I(NOW))
end

-- the run_id of the Redis process running this script (INFO server), sent back in the
-- replies of the turn scripts: a client that sees it change knows another process now serves
-- the gate's state (a promoted replica, a restart), which may lack writes it saw acknowledged
-- (replication is asynchronous), and sends its recent releases and cancels again
-- (docs/decisions.md#failover-replays-give-backs). nil where scripts cannot call INFO (fakeredis).
-- Loaded as a function library, the helpers live as long as the server process, and so does
-- SERVER_ID: read once per process (an EVAL script reads it on every call).
local SERVER_ID = nil
local function server_id()
  if SERVER_ID ~= nil then return SERVER_ID end
  local info = redis.pcall("INFO", "server")
  if type(info) == "table" and info.err then
    local err = string.lower(tostring(info.err))
    if string.find(err, "unknown", 1, true) and string.find(err, "command", 1, true) then return nil end
    info = redis.call("INFO", "server")  -- anything else (an ACL refusal) raised as Redis words it
  end
  SERVER_ID = string.match(info, "run_id:(%x+)")
  return SERVER_ID
end

-- when the gate last made progress (ms), or nil if it never did
local function last_progress()
  return tonumber(lget("progress_ms"))
end

local function epoch()
  return num(lget("epoch"), 0)
end

-- the typical tool gap: the geometric mean (an EWMA of the logarithm, so the heavy tail of
-- tool latencies does not drive it) of the seconds between a session's turns, as the clients
-- measure them (the end of its last turn to the start of this one). Stored in the ledger hash:
-- lgap (log seconds), ngap (samples). Nil until GAP_MIN_SAMPLES arrived.
local GAP_ALPHA, GAP_MIN_SAMPLES = 0.05, 8
local function note_gap(ms)
  local x = math.log(math.max(ms, 1) / 1000.0)
  local lg = tonumber(lget("lgap"))
  if lg then x = lg + GAP_ALPHA * (x - lg) end
  lset("lgap", tostring(x))
  lincr("ngap", 1)
end
local function tool_gap_s()
  local lg = lget("lgap")
  if not lg or num(lget("ngap"), 0) < GAP_MIN_SAMPLES then return nil end
  return math.exp(tonumber(lg))
end
