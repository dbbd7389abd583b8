--[[
  prefixes.lua: shared prefixes (prefixes). A prefix that several sessions' prompts start with
  (a GRPO task's prompt that its n samples all send, a system prompt that every task starts
  with) is stored once by the engines' prefix caches, so the ledger charges it once: its record
  carries the charge while any holder of it is charged, and the last holder to go gives it
  back. A turn may name nested prefixes, outermost first (the system prompt, then its task's
  prompt): each level's record charges only what that level adds to the one before it. A
  holder is whatever carries a charge of its own: a lease charged on its own, or a window. A
  holder records the prefixes it holds (pk, outermost first) and the part of its need each
  carries (ps); its own charge (t) is the rest. The record's fields: docs/keys.md#prefix.

  The ledger's psaved is what sharing saves right now: the holders' shared parts less the
  records' charges (what the ledger would hold if every holder were charged its whole need,
  less what it holds).

  A turn's prefixes, as the scripts pass them: a list of levels {k = key, t = the tokens this
  level adds to the one before it}, outermost first, or nil.

  KEYS used: prefixes (the ledger through common.lua lincr)
  Knobs read: none
]]
--@include common

-- what admitting a turn of `need` tokens with prefixes `pre` adds to the ledger now: its need
-- less the parts of its prefixes that other holders have charged already (the marginal cost
-- every fit test reads)
local function cost(need, pre)
  local c = need
  for _, lv in ipairs(pre or {}) do
    local r = jget(K.prefixes, lv.k)
    if r ~= nil then c = c - math.min(lv.t, r.t) end
  end
  return c
end

local function saved(delta)
  if delta ~= 0 then lincr("psaved", delta) end
end

-- one more holder of prefix `k` declaring `t` tokens: the first one charges the prefix. A
-- later holder that declares more than the record charges gets only what it charges (the
-- ledger never carries less than was declared by whoever charged it). Returns the holder's
-- part, and whether the record was charged already (by another holder)
local function hold_prefix(k, t)
  local r = jget(K.prefixes, k)
  if r == nil then
    jset(K.prefixes, k, { t = t, h = 1 })
    charge(t)
    stat("prefix_charged", t)
    return t, false
  end
  r.h = r.h + 1
  jset(K.prefixes, k, r)
  local ps = math.min(t, r.t)
  saved(ps)
  stat("prefix_saved", ps)
  return ps, true
end

-- a holder of prefix `k` (its part `ps`) is gone: the last one gives the prefix's charge back
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

-- make holder record `rec` (a lease or a window) hold the prefixes `pre` (nil: none) for a
-- turn of `need` tokens, and set its own charge rec.t to the rest; the caller charges the
-- change of rec.t. A prefix the holder holds already stays held (its part re-read); new ones
-- are taken before the ones it no longer names are given back, so a prefix it keeps is never
-- freed and charged again. An admission that found any of its prefixes charged by another
-- holder counts as a group admission
local function take_share(rec, pre, need)
  local old_k, old_s = rec.pk or {}, rec.ps or {}
  local kept, keys, parts, shared, joined = {}, {}, {}, 0, false
  for i, lv in ipairs(pre or {}) do
    local j = nil
    for x, k in ipairs(old_k) do
      if k == lv.k and not kept[x] then j = x end
    end
    local r = j and jget(K.prefixes, lv.k)
    local ps = 0
    if r then
      kept[j] = true
      ps = math.min(lv.t, r.t)
      saved(ps - num(old_s[j], 0))
    else
      local was
      ps, was = hold_prefix(lv.k, lv.t)
      joined = joined or was
    end
    keys[i], parts[i] = lv.k, ps
    shared = shared + ps
  end
  for x, k in ipairs(old_k) do
    if not kept[x] then drop_prefix(k, num(old_s[x], 0)) end
  end
  if joined then stat("group_admit") end
  rec.pk, rec.ps = nil, nil
  if #keys > 0 then rec.pk, rec.ps = keys, parts end
  rec.t = need - shared
end

-- a holder record ends: give back its holds of prefixes (its own charge is the caller's)
local function drop_share(rec)
  for x, k in ipairs(rec.pk or {}) do drop_prefix(k, num((rec.ps or {})[x], 0)) end
end

-- a turn's prefixes as a waiter record keeps them (pk: keys, pt: each level's tokens), and back
local function prefix_fields(pre)
  local keys, toks = {}, {}
  for i, lv in ipairs(pre) do keys[i], toks[i] = lv.k, lv.t end
  return keys, toks
end

local function waiter_prefixes(w)
  if w.pk == nil then return nil end
  local pre = {}
  for i, k in ipairs(w.pk) do pre[i] = { k = k, t = w.pt[i] } end
  return pre
end
