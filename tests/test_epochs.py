"""Epochs (SPEC 4): a change of the healthy engine set bumps the gate's epoch; a window of an
older epoch is not honoured (it ends and gives its charge back), while a turn still running
keeps its charge on the ledger until it is released. On fakeredis and a real redis-server."""
from __future__ import annotations

import json

import kvgate
from kvgate.client.probe import FakeProbe

from _gatehelpers import engines, ledger, mkgate, script


def running_charge(g) -> int:
    """What the ledger must hold: the live leases' own charges plus the windows' charges."""
    leases = sum(json.loads(v)["t"] for v in g.redis.hvals(g.key("leases")))
    windows = sum(json.loads(v)["t"] for v in g.redis.hvals(g.key("windows")))
    return leases + windows


def test_epoch_bumps_when_healthy_set_changes(backend, clock):
    g = mkgate(backend, clock, probe=FakeProbe(default=1.0))
    r = g.write_snapshot(engines(n=2))
    assert (r.epoch, r.bumped, r.capacity_tokens) == (0, False, 20_000)
    assert g.write_snapshot(engines(n=2)).bumped is False
    es = engines(n=2)
    es[1] = kvgate.EngineState(es[1].engine_id, capacity_tokens=10_000, healthy=False)
    r = g.write_snapshot(es)
    assert (r.epoch, r.bumped, r.capacity_tokens) == (1, True, 10_000)
    assert g.bump_epoch() == 2
    assert g.status()["epoch"] == 2


def test_window_of_an_old_epoch_is_not_honoured(backend, clock):
    g = mkgate(backend, clock, probe=FakeProbe(default=0.0))
    g.write_snapshot(engines(usage=0.88))
    script(g, "acquire", ticket="t", session="s", need=10, probe=0.95, retain=1)
    script(g, "release", ticket="t")
    assert ledger(g) == 10
    g.bump_epoch()
    r = script(g, "acquire", ticket="t2", session="s", need=10, probe=0.1)
    assert (r["o"], r["r"]) == ("wait", "cold_prefix")
    assert ledger(g) == 0  # the stale window ended and gave its charge back


def test_an_engine_set_change_keeps_a_running_turns_charge(backend, clock):
    g = mkgate(backend, clock, max_wait_s=30.0, headroom=1.0)
    g.write_snapshot(engines(usage=0.1, cap=500, n=2))  # capacity 1000
    a = script(g, "acquire", ticket="A", session="s", need=600, probe=0.0, retain=1)
    assert a["o"] == "admit"
    # the engine set changes (epoch 1) while A runs
    g.write_snapshot([kvgate.EngineState("http://127.0.0.1:9000", capacity_tokens=1000, usage=0.1, healthy=True,
                                         url="http://127.0.0.1:9000")])
    b = script(g, "acquire", ticket="B", session="s", need=300, probe=0.0, retain=1)
    assert b["o"] == "admit"
    # A (600) and B (300) both run: the ledger holds both, so X (650) does not fit
    assert ledger(g) == 900 == running_charge(g)
    x = script(g, "acquire", ticket="X", session="x", need=650, probe=0.0, retain=0)
    assert x["o"] == "wait"
    # A's release ends the old window and gives its charge back; X then fits
    script(g, "release", ticket="A", latency_ms=1.0, turn_index=0)
    assert not g.redis.hexists(g.key("windows"), "s") or json.loads(g.redis.hget(g.key("windows"), "s"))["ep"] == 1
    assert ledger(g) == running_charge(g)
    assert g.redis.hexists(g.key("leases"), "X")  # granted at A's release
    script(g, "release", ticket="B", latency_ms=1.0, turn_index=0)
