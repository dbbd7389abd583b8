"""SPEC section 8: "Redis server time is the one clock in production (no client skew)".

A real redis-server (tests/conftest.py), no injected clock, both gates (the ``driver``
fixture): the client process's wall clock (``time.time`` and ``time.time_ns``) is moved an
hour ahead or behind. A snapshot written then
still counts as fresh (the turn is admitted ``open``, never ``degraded``), and every time the
scripts store (the snapshot's ``ts_ms``, the lease expiry in ``lease_exp``, an idle window's
grace expiry in ``window_exp``, docs/keys.md) lies between two readings of Redis ``TIME``
taken around the call, an hour away from the client's clock.
"""
from __future__ import annotations

import json
import time

import pytest
import redis

import kvgate

pytestmark = pytest.mark.redis_real

SKEW_S = 3600.0
TTL_S = 600.0
GRACE_S = 60.0


def _engines():
    return [kvgate.EngineState("http://127.0.0.1:9501", capacity_tokens=100_000, usage=0.1,
                               url="http://127.0.0.1:9501")]


def _config() -> kvgate.GateConfig:
    return kvgate.GateConfig(lease_ttl_s=TTL_S, idle_grace_s=GRACE_S, staleness_s=6.0)


def _server_ms(r: redis.Redis) -> int:
    s, us = r.time()
    return int(s) * 1000 + int(us) // 1000


@pytest.fixture(params=[SKEW_S, -SKEW_S], ids=["client_an_hour_ahead", "client_an_hour_behind"])
def skewed(request, monkeypatch):
    """Move this process's wall clock by the param; returns the skew in seconds."""
    skew = request.param
    real_time, real_time_ns = time.time, time.time_ns
    monkeypatch.setattr(time, "time", lambda: real_time() + skew)
    monkeypatch.setattr(time, "time_ns", lambda: real_time_ns() + int(skew * 1e9))
    return skew


def _check_clock(r: redis.Redis, skew: float) -> None:
    # the patch took: this process's clock is an hour off Redis' (the same host's real clock)
    assert abs(time.time() * 1000 - _server_ms(r) - skew * 1000) < 60_000
    assert abs(time.time_ns() / 1e6 - _server_ms(r) - skew * 1000) < 60_000


def _check_stored_times(r: redis.Redis, g, ticket: str, t_snap: tuple[int, int], t_acq: tuple[int, int]) -> None:
    """The snapshot's time, the lease's admission time and its expiry: Redis TIME of the call."""
    ts = int(r.hget(g.key("snapshot"), "ts_ms"))
    assert t_snap[0] <= ts <= t_snap[1], (ts, t_snap)
    lease = json.loads(r.hget(g.key("leases"), ticket))
    assert t_acq[0] <= lease["a"] <= t_acq[1], (lease, t_acq)
    exp = r.zscore(g.key("lease_exp"), ticket)
    assert t_acq[0] + TTL_S * 1000 <= exp <= t_acq[1] + TTL_S * 1000, (exp, t_acq)


def test_the_gate_uses_redis_time_not_the_clients(redis_url, skewed, driver):
    r = redis.Redis.from_url(redis_url)
    _check_clock(r, skewed)
    g = driver.from_url(redis_url, gate="clock", config=_config())
    try:
        before = _server_ms(r)
        driver(g.write_snapshot(_engines()))
        t_snap = (before, _server_ms(r))
        before = _server_ms(r)
        lease = driver(g.acquire("s", prompt_tokens=100, max_new_tokens=10))
        t_acq = (before, _server_ms(r))
        assert (lease.outcome, lease.reason) == ("admit", "open")  # fresh, not "degraded"
        st = driver(g.status())
        assert not st["degraded"] and 0 <= st["snapshot_age_s"] < 60
        _check_stored_times(r, g, lease.ticket, t_snap, t_acq)
        # the idle window's grace runs on the server's clock too
        before = _server_ms(r)
        driver(lease.release())
        t_rel = (before, _server_ms(r))
        x = r.zscore(g.key("window_exp"), "s")
        assert x is not None and t_rel[0] + GRACE_S * 1000 <= x <= t_rel[1] + GRACE_S * 1000, (x, t_rel)
        assert json.loads(r.hget(g.key("windows"), "s"))["x"] == x
        # and the next turn of the session re-enters its window (not expired by a skewed clock)
        again = driver(g.acquire("s", prompt_tokens=120, max_new_tokens=10))
        assert (again.outcome, again.reason) == ("admit", "reserved_session")
        driver(again.release())
        assert driver(g.finish_session("s"))["window"] == 1
    finally:
        driver.close(g)
        r.close()
