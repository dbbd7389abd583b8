"""SPEC section 4: "expired windows are purged lazily by whoever looks next (bounded work per
call) and by the poller, and every purge or release wakes waiters".

A turn waits in the FIFO behind an idle ownership window that holds the ledger; the injected
script clock moves past ``idle_grace_s``; then the gate's housekeeping (called directly, or a
leader poller's tick), or the next caller's own script, purges the window, grants the waiter
and publishes the grant. The waiter polls only every 60 s, so a waiter back within the bound
below was woken by that message, not by its poll. Both backends: fakeredis and a private
redis-server (tests/conftest.py).
"""
from __future__ import annotations

import contextlib
import threading

import pytest

import kvgate
from kvgate.control.poller import Poller

from _gatehelpers import ParkingGate, config, engines, ledger, mkgate, script, stat
from _httphelpers import FakeHTTP, sglang_metrics, text

GRACE_S = 30.0
POLL_S = 60.0          # a waiter re-checks on its own only this rarely
WAKE_BOUND_S = 20.0    # far below one poll: a waiter back within it was woken by pub/sub
CAP = 1000             # headroom 1.0: ceiling 1000 tokens
OWNER = 900            # the idle window's charge: no room for WAITER behind it
WAITER = 200

#: the gate's knobs
KNOBS = dict(headroom=1.0, idle_grace_s=GRACE_S, wait_poll_s=POLL_S, max_wait_s=2 * POLL_S, staleness_s=6.0)


class _Waiter:
    """A turn of WAITER tokens acquiring on its own gate, in a thread."""

    def __init__(self, backend, clock):
        self.gate = ParkingGate(backend(), gate="pw", config=config(**KNOBS), clock_ms=clock)
        self.out: dict = {}
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.out["lease"] = self.gate.acquire("waiter", prompt_tokens=WAITER, max_new_tokens=0)
        except BaseException as e:  # noqa: BLE001 - reported by result()
            self.out["error"] = e

    def result(self, timeout: float = WAKE_BOUND_S) -> kvgate.Lease:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), (
            f"the waiter was not woken within {timeout}s (its own poll is {POLL_S}s away)")
        assert "error" not in self.out, self.out.get("error")
        return self.out["lease"]

    def close(self) -> None:
        self.thread.join(1.0)
        self.gate.close()


def _gate(backend, clock) -> kvgate.Gate:
    return mkgate(backend, clock, gate="pw", **KNOBS)


def _idle_window_and_parked_waiter(g, backend, clock) -> tuple[_Waiter, str]:
    """The owner's idle window holds OWNER of CAP; a WAITER turn parks in the FIFO behind it."""
    owner = g.acquire("owner", prompt_tokens=OWNER, max_new_tokens=0)
    assert (owner.outcome, owner.reason) == ("admit", "open")
    owner.release()  # the window turns idle for idle_grace_s, still charged
    assert g.redis.hexists(g.key("windows"), "owner") and ledger(g) == OWNER
    w = _Waiter(backend, clock)
    ticket = w.gate.parked()  # enqueued, subscribed, and asleep until a message or its poll
    assert w.gate.replies[0][1]["r"] == "capacity_exhausted", w.gate.replies
    assert g.redis.zrange(g.key("fifo"), 0, -1) == [ticket.encode()]
    return w, ticket


def _assert_granted_after_purge(g, w: _Waiter, ticket: str) -> None:
    lease = w.result()
    assert (lease.outcome, lease.reason, lease.held, lease.ticket) == ("admit", "open", True, ticket)
    assert lease.waited_s == pytest.approx(GRACE_S + 1)  # by the scripts' clock: enqueue to grant
    rec = g.redis.hget(g.key("leases"), ticket)
    assert rec is not None and b'"c":0' in rec.replace(b" ", b"")  # granted, then claimed by its waiter
    assert not g.redis.hexists(g.key("windows"), "owner")
    assert stat(g, "window_expired") == 1
    assert g.redis.zcard(g.key("fifo")) == 0
    assert ledger(g) == WAITER  # the owner's charge went back once; the waiter's window holds its own
    lease.release()
    for sid in ("owner", "waiter"):
        g.finish_session(sid)
    assert ledger(g) == 0


@contextlib.contextmanager
def _grace_over(backend, clock):
    """An idle window past its grace, not purged yet, and a waiter parked behind it: (gate,
    the waiter's gate, its ticket)."""
    g = _gate(backend, clock)
    g.write_snapshot(engines(cap=CAP, usage=0.1))
    w, ticket = _idle_window_and_parked_waiter(g, backend, clock)
    try:
        clock.advance(GRACE_S + 1)
        # a fresh snapshot (what the poller writes each tick) purges nothing and grants nothing:
        # the window still holds the ledger and the waiter still waits
        g.write_snapshot(engines(cap=CAP, usage=0.1))
        assert g.redis.hexists(g.key("windows"), "owner") and g.redis.zcard(g.key("fifo")) == 1
        assert stat(g, "window_expired") == 0
        yield g, w, ticket
    finally:
        w.close()
        g.close()


def test_housekeep_purges_an_expired_window_and_wakes_the_waiter(backend, clock):
    with _grace_over(backend, clock) as (g, w, ticket):
        hk = g.housekeep()
        assert (hk["windows"], hk["granted"]) == (1, 1), hk
        _assert_granted_after_purge(g, w, ticket)


def test_the_next_callers_lazy_purge_wakes_the_waiter(backend, clock):
    with _grace_over(backend, clock) as (g, w, ticket):
        # no housekeeping: another session's turn is the next to look, and its script purges
        # the expired window; the FIFO head (the waiter) goes first, then this small turn fits
        r = script(g, "acquire", ticket="t-next", session="next", need=50, probe=-2, retain=0)
        assert (r["o"], r["r"]) == ("admit", "open"), r
        assert g.redis.hget(g.key("leases"), ticket) is not None  # granted by that call
        script(g, "release", ticket="t-next")
        _assert_granted_after_purge(g, w, ticket)


@pytest.fixture
def engine():
    s = FakeHTTP().start()
    s.route("GET", "/metrics", text(sglang_metrics(CAP, 100)))  # usage 0.1, capacity CAP
    yield s
    s.stop()


def _poller(g, engine, identity: str) -> Poller:
    # a lease far longer than the test: leadership never lapses between the ticks below
    return Poller(g, engines=[engine.url], leader_ttl_s=600.0, identity=identity)


def test_the_leader_pollers_tick_purges_and_wakes_the_waiter(backend, clock, engine):
    g = _gate(backend, clock)
    leader = _poller(g, engine, "A")
    first = leader.tick()
    assert first.leader and first.wrote, first.reason
    w, ticket = _idle_window_and_parked_waiter(g, backend, clock)
    try:
        clock.advance(GRACE_S + 1)
        res = leader.tick()
        assert res.leader and res.wrote, res.reason
        assert (res.housekeep["windows"], res.housekeep["granted"]) == (1, 1), res.housekeep
        _assert_granted_after_purge(g, w, ticket)
    finally:
        w.close()
        leader.release()
        g.close()


def test_a_standby_poller_does_not_housekeep(backend, clock, engine):
    g = _gate(backend, clock)
    leader = _poller(g, engine, "A")
    standby = _poller(_gate(backend, clock), engine, "B")
    assert leader.tick().leader
    w, ticket = _idle_window_and_parked_waiter(g, backend, clock)
    try:
        clock.advance(GRACE_S + 1)
        # fresh, as the leader keeps it (the poller's engine id: no epoch bump)
        g.write_snapshot([kvgate.EngineState(engine.url, capacity_tokens=CAP, usage=0.1, url=engine.url)])
        assert g.status()["epoch"] == 0 and not g.status()["degraded"]
        res = standby.tick()
        assert (res.leader, res.reason, res.wrote, res.housekeep) == (False, "standby", False, None)
        # nothing was purged or granted: the window still holds the ledger, the waiter waits
        assert g.redis.hexists(g.key("windows"), "owner") and ledger(g) == OWNER
        assert g.redis.zrange(g.key("fifo"), 0, -1) == [ticket.encode()]
        assert g.redis.hget(g.key("leases"), ticket) is None
        assert stat(g, "window_expired") == 0
        assert w.thread.is_alive()
        # the leader steps down; the former standby's next tick leads, and housekeeps
        leader.release()
        res = standby.tick()
        assert res.leader and (res.housekeep["windows"], res.housekeep["granted"]) == (1, 1), res
        _assert_granted_after_purge(g, w, ticket)
    finally:
        w.close()
        standby.release()
        standby.gate.close()
        g.close()
