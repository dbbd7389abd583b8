"""Faults of the gate's scripts reviews found (each reproduced on a real server and on
fakeredis): an engine-set change took a running turn's charge off the ledger; room freed by an
acquire's own reclaim woke nobody on most of its answers; a new attempt back from its probe
round trip aged from its enqueue, not from when it began; a release whose turn index was JSON
null recorded its latency as turn 0's."""
from __future__ import annotations

import json

import pytest

import kvgate

from _gatehelpers import Clock, engines, script


def mkgate(backend, clock, **cfg):
    base = dict(wait_poll_s=0.2, max_wait_s=30.0, staleness_s=6.0, headroom=1.0)
    return kvgate.Gate(backend(), gate="lr", config=kvgate.GateConfig(**{**base, **cfg}), clock_ms=clock)


def reserved(g) -> int:
    return int(g.redis.hget(g.key("ledger"), "reserved") or 0)


def running_charge(g) -> int:
    """What the ledger must hold: the live leases' own charges plus the windows' charges."""
    leases = sum(json.loads(v)["t"] for v in g.redis.hvals(g.key("leases")))
    windows = sum(json.loads(v)["t"] for v in g.redis.hvals(g.key("windows")))
    return leases + windows


def test_an_engine_set_change_keeps_a_running_turns_charge(backend):
    clock = Clock()
    g = mkgate(backend, clock)
    g.write_snapshot(engines(usage=0.1, cap=500, n=2))  # capacity 1000
    a = script(g, "acquire", ticket="A", session="s", need=600, probe=0.0, retain=1)
    assert a["o"] == "admit"
    # the engine set changes (epoch 1) while A runs
    g.write_snapshot([kvgate.EngineState("http://127.0.0.1:9000", capacity_tokens=1000, usage=0.1, healthy=True,
                                         url="http://127.0.0.1:9000")])
    b = script(g, "acquire", ticket="B", session="s", need=300, probe=0.0, retain=1)
    assert b["o"] == "admit"
    # A (600) and B (300) both run: the ledger holds both, so X (650) does not fit
    assert reserved(g) == 900 == running_charge(g)
    x = script(g, "acquire", ticket="X", session="x", need=650, probe=0.0, retain=0)
    assert x["o"] == "wait"
    # A's release ends the old window and gives its charge back; X then fits
    script(g, "release", ticket="A", latency_ms=1.0, turn_index=0)
    assert not g.redis.hexists(g.key("windows"), "s") or json.loads(g.redis.hget(g.key("windows"), "s"))["ep"] == 1
    assert reserved(g) == running_charge(g)
    assert g.redis.hexists(g.key("leases"), "X")  # granted at A's release
    script(g, "release", ticket="B", latency_ms=1.0, turn_index=0)


@pytest.mark.parametrize("how", ["probe", "protected"])
def test_room_an_acquire_reclaims_goes_to_the_fifo_head_at_once(backend, how):
    clock = Clock()
    g = mkgate(backend, clock, lease_ttl_s=2.0, wait_poll_s=5.0)  # B's record outlives the 2.5 s
    g.write_snapshot(engines(usage=0.1, cap=1000))
    assert script(g, "acquire", ticket="A", session="a", need=900, probe=0.0, retain=0)["o"] == "admit"
    assert script(g, "acquire", ticket="B", session="b", need=500, probe=0.0, retain=0)["o"] == "wait"
    clock.advance(2.5)  # A's lease expires (its holder died); the snapshot is still fresh
    extra = dict(probe=-1) if how == "probe" else dict(probe=0.0, protected=1)
    r = script(g, "acquire", ticket="C", session="c", need=100, retain=0, **extra)
    assert r["o"] == ("probe" if how == "probe" else "bypass")
    # C's reclaim freed A's 900 tokens: B is granted now, not at its own next poll
    assert g.redis.zcard(g.key("fifo")) == 0
    assert g.redis.hexists(g.key("leases"), "B")


def test_a_new_attempt_back_from_its_probe_ages_from_when_it_began(backend):
    clock = Clock()
    g = mkgate(backend, clock, max_wait_s=0.3, admission=True)
    g.write_snapshot(engines(usage=0.88, cap=1000))  # between the watermark and the guard: T must probe
    r = script(g, "acquire", ticket="T", session="s", need=100, probe=-1, retain=1)
    assert r["o"] == "probe"
    clock.advance(0.5)  # a probe that took its whole timeout; max_wait_s (0.3 s) has passed
    r2 = script(g, "acquire", ticket="T", session="s", need=100, probe=0.1, retain=1, t0=r["b"])
    assert r2["o"] in ("admit", "bypass") and r2["r"] == "aged"  # not one more "wait" round trip


def test_a_release_with_a_null_turn_index_records_no_latency(backend):
    clock = Clock()
    g = mkgate(backend, clock)
    g.write_snapshot(engines(usage=0.1, cap=1000))
    assert script(g, "acquire", ticket="A", session="a", need=10, probe=0.0, retain=0)["o"] == "admit"
    # a JSON null is an absent parameter: no turn index, so no per-turn-index sample
    assert script(g, "release", ticket="A", latency_ms=5.0, turn_index=None)["released"] == 1
    assert not [f for f in g.redis.hkeys(g.key("totals")) if f.startswith(b"lat_")]
