--[[
  bump_epoch.lua: start a new generation of the engine set by hand (an operator replaced
  engines without the poller noticing). Windows of older epochs stop counting as resident
  and are ended lazily when their session next looks.

  KEYS: the 14 gate keys (includes/common.lua).
  ARGV[1] now ms or ""; ARGV[2] JSON: ch (channel).
  Returns JSON {epoch=n}
  Publishes "e <epoch>".
]]
--@include common

redis.call("HINCRBY", K.ledger, "epoch", 1)
stat("epoch_bumps")
publish("e " .. I(epoch()))
return cjson.encode({ epoch = epoch() })
