--[[
  finish_session.lua: a session is done. Ends its ownership window (returning the window's
  charge), stops its waiting attempt (it raises Preempted with reason "session_finished"),
  forgets its preemption count, and advances the FIFO.

  KEYS used: ledger, snapshot, fifo, waiters, alive, session_waiter, leases, lease_exp,
    windows, window_exp, totals, preempted, window_order, prefixes
  ARGV[1] now: the clock in ms, or "" for the Redis server clock (TIME)
  ARGV[2] JSON object of named parameters:
    session (str, required): the session that is done
    again (0|1, optional): 1 when the client sends a finish again because another Redis
      process answers (a failover may have lost it); counted in session_finished only when
      it still ended a window, stopped an attempt or forgot a preemption count
  ARGV[3] knobs (includes/common.lua): admission, residency, high_watermark,
    pressure_threshold, headroom, budget_scale, staleness_ms, lease_ttl_ms, claim_ms,
    reap_batch, channel
  Returns: JSON {window=0|1, freed=<tokens returned>, stopped=<ticket or "">,
    num_preempted=<its preempted attempts>, srv=the Redis process's run_id (common.lua server_id)}
  Publishes: "p <ticket>" for the stopped attempt, "g <ticket>" for FIFO grants.
  Errors: a required parameter that is missing (includes/common.lua).
]]
--@include common
--@include snapshot
--@include windows
--@include leases
--@include waiters
account()

local s = P.session
local res = { window = 0, freed = 0, stopped = "", num_preempted = num(redis.call("HGET", K.preempted, s), 0) }
local win = jget(K.windows, s)
if win then
  -- its own charge, and its shared prefix's when it was the prefix's last holder
  local before = reserved()
  end_window(s, win)
  res.window = 1
  res.freed = before - reserved()
end
local t = redis.call("HGET", K.session_waiter, s)
if t then
  local w = jget(K.waiters, t)
  if w and w.st == "w" then
    redis.call("ZREM", K.fifo, t)
    w.st = "f"
    jset(K.waiters, t, w)
    res.stopped = t
    publish("p " .. t, w.ch)
  end
  redis.call("HDEL", K.session_waiter, s)
end
local forgot = redis.call("HDEL", K.preempted, s)
if OPT.again ~= 1 or res.window == 1 or res.stopped ~= "" or forgot == 1 then
  stat("session_finished")
end
advance(P.reap_batch, nil)
res.srv = server_id()
return cjson.encode(res)
