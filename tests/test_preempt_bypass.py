"""Attempt preemption applies to every attempt (SPEC 4), the ones that bypass included: a
protected or degraded retry of a session ends its older waiting attempt instead of leaving it
to be admitted too (both attempts of one turn would run and the stale one would be charged)."""
from __future__ import annotations

import pytest

import kvgate

from _gatehelpers import Clock, engines, make_client, script

FAST = dict(wait_poll_s=0.2, max_wait_s=2.0, staleness_s=6.0)


def mkgate(backend, clock, **cfg):
    return kvgate.Gate(backend(), gate="pb", config=kvgate.GateConfig(**{**FAST, **cfg}), clock_ms=clock)


def fifo(g) -> list[bytes]:
    return g.redis.zrange(g.key("fifo"), 0, -1)


def test_a_protected_retry_preempts_the_waiting_attempt():
    clock = Clock()
    g = kvgate.Gate(make_client("fake", None), gate="pb", config=kvgate.GateConfig(**FAST), clock_ms=clock)
    g.write_snapshot(engines(usage=0.95))  # above the pressure guard: everyone waits
    assert script(g, "acquire", ticket="T1", session="s", need=10, probe=0.0)["o"] == "wait"
    clock.advance(0.1)
    r = script(g, "acquire", ticket="T2", session="s", need=10, probe=0.0, protected=1)
    assert (r["o"], r["r"]) == ("bypass", "protected")
    assert fifo(g) == []
    assert g.num_preempted("s") == 1
    # the stale attempt learns it at its next check, and its record goes
    assert script(g, "acquire", ticket="T1", session="s", need=10, probe=0.0)["o"] == "preempted"
    assert not g.redis.hexists(g.key("waiters"), "T1")
    assert not g.redis.hexists(g.key("session_waiter"), "s")


def test_a_degraded_retry_preempts_the_waiting_attempt(backend):
    clock = Clock()
    g = mkgate(backend, clock, staleness_s=1.0, wait_poll_s=2.0)  # T1 stays alive meanwhile
    g.write_snapshot(engines(usage=0.95))
    assert script(g, "acquire", ticket="T1", session="s", need=10, probe=0.0)["o"] == "wait"
    clock.advance(1.5)  # past staleness_s: the next attempt bypasses as degraded
    assert g.redis.hexists(g.key("waiters"), "T1")
    r = script(g, "acquire", ticket="T2", session="s", need=10, probe=0.0)
    assert (r["o"], r["r"]) == ("bypass", "degraded")
    assert g.num_preempted("s") == 1
    assert script(g, "acquire", ticket="T1", session="s", need=10, probe=0.0)["o"] == "preempted"


def test_the_head_that_a_protected_retry_ends_lets_the_next_waiter_in(backend):
    # T1 heads the FIFO and does not fit; X, behind it, would fit but waits (strict FIFO).
    # A protected retry of T1's session ends T1: X is granted at once, not at the next release
    clock = Clock()
    g = mkgate(backend, clock, admission=True, residency=False)
    g.write_snapshot(engines(usage=0.5, cap=1000))  # ceiling 900
    assert script(g, "acquire", ticket="H", session="h", need=800, probe=0.0)["o"] == "admit"
    assert script(g, "acquire", ticket="T1", session="s", need=500, probe=0.0)["o"] == "wait"
    clock.advance(0.1)
    assert script(g, "acquire", ticket="X", session="x", need=10, probe=0.0)["o"] == "wait"
    assert fifo(g) == [b"T1", b"X"]
    clock.advance(0.1)
    r = script(g, "acquire", ticket="T2", session="s", need=10, probe=0.0, protected=1)
    assert (r["o"], r["r"]) == ("bypass", "protected")
    assert fifo(g) == []
    assert g.redis.hexists(g.key("leases"), "X")  # the grant, claimable by X
    rx = script(g, "acquire", ticket="X", session="x", need=10, probe=0.0)
    assert (rx["o"], rx["r"]) == ("admit", "open")
