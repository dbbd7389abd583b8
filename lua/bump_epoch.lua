--[[
  bump_epoch.lua: start a new generation of the engine set by hand (an operator replaced
  engines without the poller noticing). Windows of older epochs stop counting as resident
  and are ended lazily when their session next looks.

  KEYS used: ledger, totals
  ARGV[1] now: the clock in ms, or "" for the Redis server clock (TIME)
  ARGV[2] JSON object of named parameters: none (an empty object)
  ARGV[3] knobs (includes/common.lua): channel
  Returns: JSON {epoch=n}
  Publishes: "e <epoch>".
  Errors: a required parameter that is missing (includes/common.lua).
]]
--@include common

lincr("epoch", 1)
stat("epoch_bumps")
publish("e " .. I(epoch()))
return cjson.encode({ epoch = epoch() })
