--[[
  prefixes.lua: shared prefixes (prefixes). A prefix that several sessions' prompts start with
  (a GRPO task's prompt that its n samples all send, a system prompt) is stored once by the
  engines' prefix caches, so the ledger charges it once: its record carries the charge while
  any holder of it is charged, and the last holder to go gives it back. A holder is whatever
  carries a charge of its own: a lease charged on its own, or a window. A holder records the
  prefix it holds (pk) and the part of its need the prefix carries (ps); its own charge (t) is
  the rest. The record's fields: docs/keys.md#prefix.

  The ledger's psaved is what sharing saves right now: the holders' shared parts less the
  records' charges (what the ledger would hold if every holder were charged its whole need,
  less what it holds).

  KEYS used: prefixes, ledger
  Knobs read: none
]]
--@include common

-- what admitting a turn of `need` tokens with prefix `pre` adds to the ledger now: its need
-- less the part its prefix carries when another holder has the prefix charged already (the
-- marginal cost every fit test reads)
local function cost(need, pre)
  if pre == nil then return need end
  local r = jget(K.prefixes, pre.k)
  if r == nil then return need end
  return need - math.min(pre.t, r.t)
end

local function saved(delta)
  if delta ~= 0 then redis.call("HINCRBY", K.ledger, "psaved", I(delta)) end
end

-- one more holder of prefix `k` declaring `t` tokens: the first one charges the prefix. A
-- later holder that declares more than the record charges gets only what it charges (the
-- ledger never carries less than was declared by whoever charged it). Returns the holder's ps.
local function hold_prefix(k, t)
  local r = jget(K.prefixes, k)
  if r == nil then
    jset(K.prefixes, k, { t = t, h = 1 })
    charge(t)
    stat("prefix_charged", t)
    return t
  end
  r.h = r.h + 1
  jset(K.prefixes, k, r)
  local ps = math.min(t, r.t)
  saved(ps)
  stat("group_admit")
  stat("prefix_saved", ps)
  return ps
end

-- a holder of prefix `k` (its shared part `ps`) is gone: the last one gives its charge back
local function drop_prefix(k, ps)
  local r = jget(K.prefixes, k)
  if r == nil then return end
  r.h = r.h - 1
  if r.h <= 0 then
    redis.call("HDEL", K.prefixes, k)
    charge(-r.t)
    saved(r.t - ps)
  else
    jset(K.prefixes, k, r)
    saved(-ps)
  end
end

-- make holder record `rec` (a lease or a window) hold prefix `pre` (nil: none) for a turn of
-- `need` tokens, and set its own charge rec.t to the rest; the caller charges the change of
-- rec.t. A holder that keeps its prefix keeps its hold; one that changes it takes the new hold
-- before it gives the old one back
local function take_share(rec, pre, need)
  local old, old_ps = rec.pk, num(rec.ps, 0)
  if pre ~= nil and old == pre.k and jget(K.prefixes, old) ~= nil then
    local ps = math.min(pre.t, jget(K.prefixes, old).t)
    saved(ps - old_ps)
    rec.ps = ps
  else
    if pre ~= nil then
      rec.ps = hold_prefix(pre.k, pre.t)
      rec.pk = pre.k
    else
      rec.pk, rec.ps = nil, nil
    end
    if old ~= nil then drop_prefix(old, old_ps) end
  end
  rec.t = need - num(rec.ps, 0)
end

-- a holder record ends: give back its hold of a prefix (its own charge is the caller's)
local function drop_share(rec)
  if rec.pk ~= nil then drop_prefix(rec.pk, num(rec.ps, 0)) end
end
