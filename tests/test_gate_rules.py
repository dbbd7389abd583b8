"""Every rule and reason of the decision table (SPEC section 4), on fakeredis and on a
real redis-server started by the tests. Time is injected into the scripts where a test
needs to move it; waits that involve other threads use the real clock."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

import kvgate
from kvgate.client.probe import FakeProbe

from _gatehelpers import FAST, LONG_POLL, WAKE_S, ParkingGate, engines, ledger, mkgate, script, stat


# -- rule 1: pass-through ---------------------------------------------------------------
def test_rule1_no_feature_passes_through(backend):
    g = mkgate(backend, admission=False, residency=False)
    lease = g.acquire("s", prompt_tokens=10, max_new_tokens=10)
    assert (lease.outcome, lease.reason, lease.held) == ("pass", "", False)
    assert g.redis.keys("*") == []  # nothing touched Redis


def test_rule1_scope(backend, clock):
    g = mkgate(backend, clock)
    g.write_snapshot(engines())
    assert g.acquire("s", prompt_tokens=1, max_new_tokens=1, scope="eval").outcome == "pass"
    g_all = mkgate(backend, clock, scope="all")
    lease = g_all.acquire("s", prompt_tokens=1, max_new_tokens=1, scope="eval")
    assert (lease.outcome, lease.reason) == ("admit", "open")


# -- rule 2: protected --------------------------------------------------------------------
def test_rule2_protected_bypasses_even_under_pressure(backend, clock):
    g = mkgate(backend, clock)
    g.write_snapshot(engines(usage=0.99))
    lease = g.acquire("s", prompt_tokens=10, max_new_tokens=10, protected=True)
    assert (lease.outcome, lease.reason) == ("bypass", "protected")
    assert ledger(g) == 0


def test_rule2_protected_when_redis_down():
    g = kvgate.Gate.from_url("redis://127.0.0.1:1/0", gate="g", config=kvgate.GateConfig(redis_timeout_s=0.2))
    lease = g.acquire("s", prompt_tokens=1, max_new_tokens=1, protected=True)
    assert (lease.outcome, lease.reason) == ("bypass", "protected")


# -- rule 3: degraded ---------------------------------------------------------------------
def test_rule3_no_snapshot_is_degraded(backend, clock):
    g = mkgate(backend, clock)
    lease = g.acquire("s", prompt_tokens=10, max_new_tokens=10)
    assert (lease.outcome, lease.reason) == ("bypass", "degraded")


def test_rule3_stale_snapshot_is_degraded(backend, clock):
    g = mkgate(backend, clock, staleness_s=6.0)
    g.write_snapshot(engines())
    clock.advance(5.9)
    assert g.acquire("s", prompt_tokens=1, max_new_tokens=1).reason == "open"
    clock.advance(0.2)
    assert g.acquire("s", prompt_tokens=1, max_new_tokens=1).reason == "degraded"


def test_rule3_no_healthy_engine_is_degraded(backend, clock):
    g = mkgate(backend, clock)
    g.write_snapshot(engines(healthy=False))
    assert g.acquire("s", prompt_tokens=1, max_new_tokens=1).reason == "degraded"


def test_rule3_redis_unreachable_fails_open_fast(driver):
    g = driver.from_url("redis://127.0.0.1:1/0", gate="g", config=kvgate.GateConfig(redis_timeout_s=0.3))
    t0 = time.monotonic()
    for _ in range(20):
        lease = driver(g.acquire("s", prompt_tokens=1, max_new_tokens=1))
        assert (lease.outcome, lease.reason) == ("bypass", "degraded")
        driver(lease.release())
    assert driver(g.finish_session("s"))["session_id"] == "s"
    m = driver(g.step_metrics())
    assert m["agentic_kv/admission/bypass_degraded"] == 20
    assert m["agentic_kv/budget/degraded"] == 1.0

    def degraded(lease):
        assert lease.reason == "degraded"
    for _ in range(5):  # a turn() too
        driver.turn(g, "s", degraded, prompt_tokens=1, max_new_tokens=1)
    driver(g.finish_session("s"))
    assert time.monotonic() - t0 < 10  # a bound on the hang, not a performance claim
    driver.close(g)


def test_rule3_waiting_ticket_bypasses_when_snapshot_goes_stale(backend, clock):
    g = mkgate(backend, clock)
    g.write_snapshot(engines(usage=0.95))
    r = script(g, "acquire", ticket="t1", session="s", need=10, probe=-2)
    assert r["o"] == "wait"
    clock.advance(7)
    r = script(g, "acquire", ticket="t1", session="s", need=10, probe=-2)
    assert (r["o"], r["r"]) == ("bypass", "degraded")
    assert g.redis.zcard(g.key("fifo")) == 0


# -- rule 4: idempotent per ticket --------------------------------------------------------
def test_rule4_same_ticket_same_lease_charged_once(backend, clock):
    g = mkgate(backend, clock)
    g.write_snapshot(engines())
    a = script(g, "acquire", ticket="t1", session="s", need=100, probe=-2)
    b = script(g, "acquire", ticket="t1", session="s", need=100, probe=-2)
    assert a["o"] == b["o"] == "admit" and b.get("held") == 1
    assert ledger(g) == 100
    assert stat(g, "admit") == 1
    assert script(g, "release", ticket="t1")["released"] == 1
    assert script(g, "release", ticket="t1")["released"] == 0
    assert ledger(g) == 0


# -- rule 6: open, and the three wait reasons --------------------------------------------
def test_rule6_open_and_capacity_exhausted(backend, clock):
    g = mkgate(backend, clock, headroom=0.5, residency=False)
    g.write_snapshot(engines(cap=1000, usage=0.1))  # ceiling 500
    a = g.acquire("a", prompt_tokens=300, max_new_tokens=100)
    assert (a.reason, a.tokens) == ("open", 400)
    r = script(g, "acquire", ticket="tb", session="b", need=200, probe=-2)
    assert (r["o"], r["r"]) == ("wait", "capacity_exhausted")
    # strict FIFO: a small turn that would fit still queues behind the head
    r = script(g, "acquire", ticket="tc", session="c", need=50, probe=-2)
    assert (r["o"], r["r"]) == ("wait", "queued")
    a.release()  # frees 400 -> head (200) granted, then c (50) fits too
    assert g.redis.hget(g.key("leases"), "tb") is not None
    assert g.redis.hget(g.key("leases"), "tc") is not None
    assert ledger(g) == 250
    rb = script(g, "acquire", ticket="tb", session="b", need=200, probe=-2)
    assert (rb["o"], rb["r"]) == ("admit", "open")


def test_rule6_expected_decode_cap_sizes_the_reservation(backend, clock):
    g = mkgate(backend, clock, expected_decode_cap=64, residency=False)
    g.write_snapshot(engines())
    lease = g.acquire("s", prompt_ids=list(range(100)), max_new_tokens=1000)
    assert lease.tokens == 164 and ledger(g) == 164


def test_rule6_pressure_guard(backend, clock):
    g = mkgate(backend, clock, residency=False)
    g.write_snapshot(engines(usage=0.93))
    r = script(g, "acquire", ticket="t", session="s", need=1, probe=-2)
    assert (r["o"], r["r"]) == ("wait", "pressure_guard")


def test_fifo_head_that_does_not_fit_blocks_later_small_ones(backend, clock):
    g = mkgate(backend, clock, headroom=1.0, residency=False)
    g.write_snapshot(engines(cap=1000))
    big = g.acquire("a", prompt_tokens=900, max_new_tokens=0)
    assert script(g, "acquire", ticket="t2", session="b", need=500, probe=-2)["r"] == "capacity_exhausted"
    assert script(g, "acquire", ticket="t3", session="c", need=10, probe=-2)["r"] == "queued"
    g.housekeep()
    assert g.redis.hget(g.key("leases"), "t3") is None  # would fit, must not jump the head
    big.release()
    assert g.redis.hget(g.key("leases"), "t2") is not None
    assert g.redis.hget(g.key("leases"), "t3") is not None


# -- rules 5 and 7: residency, windows ---------------------------------------------------
def test_rule7_resident_prefix_and_rule5_window(backend, clock):
    probe = FakeProbe({"hot": 0.95, "cold": 0.1})
    g = mkgate(backend, clock, probe=probe, idle_grace_s=30)
    g.write_snapshot(engines(usage=0.88))  # between high_watermark and pressure_threshold
    hot = g.acquire("hot", prompt_ids=[1] * 100, max_new_tokens=20)
    assert (hot.outcome, hot.reason) == ("admit", "resident_prefix")
    assert g.redis.hexists(g.key("windows"), "hot")
    hot.release()
    assert ledger(g) == 120  # an idle window stays charged
    n_calls = len(probe.calls)
    again = g.acquire("hot", prompt_ids=[1] * 150, max_new_tokens=20)
    assert again.reason == "reserved_session"
    assert len(probe.calls) == n_calls  # rule 5 never probes
    assert ledger(g) == 170  # the window is re-sized to the new turn, charged once
    again.release()
    r = script(g, "acquire", ticket="tc", session="cold", need=10, probe=0.1)
    assert (r["o"], r["r"]) == ("wait", "cold_prefix")
    clock.advance(31)
    g.housekeep()
    assert not g.redis.hexists(g.key("windows"), "hot")
    assert stat(g, "window_expired") == 1


def test_window_ends_at_finish_session(backend, clock):
    g = mkgate(backend, clock, probe=FakeProbe(default=1.0))
    g.write_snapshot(engines(usage=0.88))
    with g.turn("s", prompt_ids=[1, 2, 3], max_new_tokens=5) as lease:
        assert lease.reason == "resident_prefix"
    assert ledger(g) == 8
    out = g.finish_session("s")
    assert out["window"] == 1 and out["freed"] == 8
    assert ledger(g) == 0


def test_above_pressure_only_window_owners(backend, clock):
    g = mkgate(backend, clock, probe=FakeProbe(default=1.0))
    g.write_snapshot(engines(usage=0.88))
    g.acquire("owner", prompt_ids=[1] * 10, max_new_tokens=1).release()
    g.write_snapshot(engines(usage=0.95))
    assert g.acquire("owner", prompt_ids=[1] * 10, max_new_tokens=1).reason == "reserved_session"
    r = script(g, "acquire", ticket="t", session="other", need=5, probe=-1)
    assert (r["o"], r["r"]) == ("wait", "pressure_guard")  # no probe above the guard


def test_retain_false_opens_no_window(backend, clock):
    g = mkgate(backend, clock, probe=FakeProbe(default=1.0))
    g.write_snapshot(engines(usage=0.88))
    lease = g.acquire("s", prompt_ids=[1] * 10, max_new_tokens=1, retain_session=False)
    assert lease.reason == "resident_prefix"
    lease.release()
    assert ledger(g) == 0 and not g.redis.hexists(g.key("windows"), "s")


# -- rule 8: residency without admission fails open ---------------------------------------
@pytest.mark.parametrize("probe", [None, FakeProbe(raises=RuntimeError("engine down")),
                                   FakeProbe(default=0.9, delay_s=0.5), FakeProbe(default=None)])
def test_rule8_probe_unavailable_admits(backend, clock, probe):
    g = mkgate(backend, clock, probe=probe, admission=False, probe_timeout_s=0.1)
    g.write_snapshot(engines(usage=0.97))
    lease = g.acquire("s", prompt_ids=[1] * 10, max_new_tokens=1)
    assert (lease.outcome, lease.reason) == ("admit", "prefix_probe_unavailable")


def test_failed_probe_with_admission_waits(backend, clock):
    g = mkgate(backend, clock, probe=FakeProbe(raises=RuntimeError("x")), max_wait_s=0.0)
    g.write_snapshot(engines(usage=0.88))
    lease = g.acquire("s", prompt_ids=[1] * 10, max_new_tokens=1)
    assert lease.reason == "aged"  # it would have waited (max_wait_s 0: aged at once), not rule 8


# -- waiting: aging, grants, preemption, cancellation --------------------------------------
def test_aged_admission_after_max_wait(backend):
    # both features on: an aged waiter enters with a lease and a window (docs/decisions.md)
    g = mkgate(backend, max_wait_s=0.5, wait_poll_s=0.1)
    g.write_snapshot(engines(usage=0.95))
    t0 = time.monotonic()
    lease = g.acquire("s", prompt_tokens=7, max_new_tokens=1)
    assert (lease.outcome, lease.reason, lease.held) == ("admit", "aged", True)
    assert 0.5 <= time.monotonic() - t0 < 0.5 + 0.1 + 2.0  # bound, with scheduler slack
    assert lease.waited_s >= 0.5
    assert g.redis.zcard(g.key("fifo")) == 0
    assert ledger(g) == 8 and g.redis.hexists(g.key("windows"), "s")
    lease.release()
    assert ledger(g) == 8  # its window idles, charged; the next turn is reserved_session
    nxt = g.acquire("s", prompt_tokens=9, max_new_tokens=1)
    assert nxt.reason == "reserved_session"
    nxt.release()
    g.finish_session("s")
    assert ledger(g) == 0
    m = g.step_metrics()
    assert m["agentic_kv/admission/admit_aged"] == 1 and m["agentic_kv/admission/bypass_aged"] == 0


@pytest.mark.parametrize("cfg, kw", [(dict(residency=False), {}), (dict(), dict(retain_session=False))],
                         ids=["admission-only", "no-retain"])
def test_an_aged_turn_is_admitted_with_a_lease_where_no_window_opens(backend, cfg, kw):
    # aged has one meaning: an admission holding a lease the ledger counts (docs/decisions.md)
    g = mkgate(backend, max_wait_s=0.3, wait_poll_s=0.1, **cfg)
    g.write_snapshot(engines(usage=0.95))
    lease = g.acquire("s", prompt_tokens=1, max_new_tokens=1, **kw)
    assert (lease.outcome, lease.reason, lease.held) == ("admit", "aged", True)
    assert ledger(g) == 2 and g.redis.zcard(g.key("fifo")) == 0
    assert g.redis.hlen(g.key("windows")) == 0
    lease.release()
    assert ledger(g) == 0


@pytest.mark.parametrize("residency", [True, False])
def test_local_clock_ages_a_wait_the_script_clock_does_not(backend, clock, residency):
    # the script's clock is frozen (a misbehaving Redis clock): the caller's own deadline
    # (max_wait_hard_s + one poll) asks the script to age the attempt, which admits it
    g = mkgate(backend, clock, max_wait_s=0.3, max_wait_hard_s=0.3, wait_poll_s=0.1, residency=residency)
    g.write_snapshot(engines(usage=0.95))
    t0 = time.monotonic()
    lease = g.acquire("s", prompt_tokens=4, max_new_tokens=1)
    assert (lease.outcome, lease.reason, lease.held) == ("admit", "aged", True)
    assert 0.3 <= time.monotonic() - t0 < 0.3 + 0.1 + 2.0
    assert g.redis.zcard(g.key("fifo")) == 0
    assert ledger(g) == 5
    lease.release()


def test_aged_admission_ends_the_longest_idle_windows_first(backend, clock):
    g = mkgate(backend, clock, headroom=1.0, idle_grace_s=600, max_wait_s=30)
    g.write_snapshot(engines(cap=1000, usage=0.1))
    for sid in ("a", "b", "c"):  # idle in this order: a has waited longest on its tool
        g.acquire(sid, prompt_tokens=300, max_new_tokens=0).release()
        clock.advance(1)
    busy = g.acquire("d", prompt_tokens=100, max_new_tokens=0)  # held: never given up
    assert ledger(g) == 1000
    r = script(g, "acquire", ticket="t", session="new", need=250, probe=-2, retain=1)
    assert (r["o"], r["r"]) == ("wait", "capacity_exhausted")
    for _ in range(29):  # the waiter polls once a second; the poller keeps the snapshot fresh
        clock.advance(1)
        g.write_snapshot(engines(cap=1000, usage=0.1))
        r = script(g, "acquire", ticket="t", session="new", need=250, probe=-2, retain=1)
        assert r["o"] == "wait"  # not yet aged
    clock.advance(1)
    r = script(g, "acquire", ticket="t", session="new", need=250, probe=-2, retain=1)
    assert (r["o"], r["r"], r["w"]) == ("admit", "aged", 30000)
    windows = {k.decode() for k in g.redis.hkeys(g.key("windows"))}
    assert windows == {"b", "c", "d", "new"}  # a alone gave way: 300 freed was enough
    assert ledger(g) == 950
    assert stat(g, "window_yielded") == 1
    script(g, "release", ticket="t")
    busy.release()
    for sid in ("b", "c", "d", "new"):
        g.finish_session(sid)
    assert ledger(g) == 0


def priced(states, s_per_token, load=0.1):
    import dataclasses
    return [dataclasses.replace(e, prefill_s_per_token=s_per_token, prefill_load=load) for e in states]


def report_gaps(g, ms, n):
    """n turns that report their session's time away (protected: they touch nothing else)"""
    for i in range(n):
        r = script(g, "acquire", ticket=f"gap{ms}-{i}", session=f"gs{i}", need=1, protected=1, gap=ms)
        assert r["o"] == "bypass"


def test_tool_gap_is_a_geometric_mean(backend, clock):
    # tool latencies are heavy-tailed: a few minute-long calls must not make every session
    # look far away. Alternating 0.1 s and 1 s gaps settle near their geometric mean (0.32 s),
    # and one 60 s gap moves it by a factor of 1.3 (an arithmetic EWMA would jump to 3.3 s)
    g = mkgate(backend, clock)
    for i in range(100):
        report_gaps(g, 100 if i % 2 else 1000, 1)
    gap = g.status()["tool_gap_s"]
    assert 0.25 < gap < 0.40
    report_gaps(g, 60000, 1)
    assert gap < g.status()["tool_gap_s"] < 1.35 * gap


def test_clients_report_each_sessions_time_away_once(backend, monkeypatch):
    # the sync and the async gate time a session's gap from the end of its last turn (held or
    # bypassed) to its next acquire, report it once, and forget it with the session
    from kvgate.client import flows as _flows
    from kvgate.client.flows import Eval, GateFlows, Listen, Wait
    g = mkgate(backend)
    g.write_snapshot(engines(cap=1000, usage=0.1))
    with g.turn("s", prompt_tokens=10, max_new_tokens=0) as lease:
        assert lease.admitted
    time.sleep(0.05)
    with g.turn("s", prompt_tokens=20, max_new_tokens=0):
        pass
    assert int(g.redis.hget(g.key("ledger"), "ngap")) == 1  # the first turn had no gap to report
    assert 0.05 <= 2.718281828 ** float(g.redis.hget(g.key("ledger"), "lgap")) < 5.0
    g.finish_session("s")
    assert "s" not in g._flows.last_end
    with g.turn("s", prompt_tokens=10, max_new_tokens=0):
        pass
    assert int(g.redis.hget(g.key("ledger"), "ngap")) == 1
    # bounded memory: the oldest sessions are forgotten first
    monkeypatch.setattr(_flows, "MAX_TRACKED_SESSIONS", 2)
    for sid in ("x", "y", "z"):
        g._flows.turn_ended(sid, 10)
    assert list(g._flows.last_end) == ["y", "z"] and list(g._flows.last_prompt) == ["y", "z"]
    # the flow sends the gap with the attempt's first call only, not with its re-checks
    now = [100.0]
    f = GateFlows("g1", g.config, clock=lambda: now[0])
    f.turn_ended("s", 10)
    now[0] += 0.25
    flow = f.acquire("s", has_probe=False, prompt_tokens=5, max_new_tokens=0)
    assert isinstance(next(flow), Listen)
    op = flow.send(None)
    assert isinstance(op, Eval) and op.params["gap"] == 250.0
    assert isinstance(flow.send({"o": "wait", "r": "queued", "w": 0, "mw": 30000}), Wait)
    op = flow.send("timeout")
    assert isinstance(op, Eval) and "gap" not in op.params
    flow.close()


@pytest.mark.redis_real
def test_async_gate_reports_the_gap(redis_url):
    async def main():
        g = kvgate.AsyncGate.from_url(redis_url, gate="gap", config=kvgate.GateConfig(**FAST))
        try:
            await g.write_snapshot(engines(cap=1000, usage=0.1))
            for _ in range(3):
                async with g.turn("as", prompt_tokens=10, max_new_tokens=0):
                    pass
                await asyncio.sleep(0.05)
            n = int(await g.redis.hget(g.key("ledger"), "ngap"))
            await g.finish_session("as")
            assert "as" not in g._flows.last_end
            return n
        finally:
            await g.aclose()
    assert asyncio.run(main()) == 2


def test_snapshot_keeps_the_slowest_engines_prefill_cost(backend, clock):
    g = mkgate(backend, clock)
    e = engines(cap=1000, usage=0.1, n=3)
    g.write_snapshot(priced(e[:1], 2e-4, 0.6) + priced(e[1:2], 5e-4, 0.2) + e[2:])  # e[2] measures nothing
    st = g.status()
    assert (st["prefill_s_per_token"], st["prefill_load"]) == (pytest.approx(5e-4), pytest.approx(0.6))
    g.write_snapshot(engines(cap=1000, usage=0.1))
    assert (g.status()["prefill_s_per_token"], g.status()["prefill_load"]) == (None, None)


def test_aged_admission_over_commits_when_no_window_is_idle(backend, clock):
    g = mkgate(backend, clock, headroom=1.0, max_wait_s=30)
    g.write_snapshot(engines(cap=1000, usage=0.1))
    held = g.acquire("a", prompt_tokens=900, max_new_tokens=0)
    r = script(g, "acquire", ticket="t", session="new", need=200, probe=-2, retain=1)
    assert r["o"] == "wait"
    for _ in range(30):
        clock.advance(1)
        g.write_snapshot(engines(cap=1000, usage=0.1))
        r = script(g, "acquire", ticket="t", session="new", need=200, probe=-2, retain=1)
    assert (r["o"], r["r"]) == ("admit", "aged")  # no wait past max_wait_s, even with no room
    assert ledger(g) == 1100  # over capacity: the youngest window (new's) is marked revoked
    script(g, "release", ticket="t")
    assert not g.redis.hexists(g.key("windows"), "new") and ledger(g) == 900
    held.release()
    g.finish_session("a")
    assert ledger(g) == 0


# -- aging: a liveness guard (SPEC 4) ----------------------------------------------------
def wait_call(g, ticket, session, need=200):
    return script(g, "acquire", ticket=ticket, session=session, need=need, probe=-2, retain=1)


def test_the_head_waits_while_the_gate_makes_progress(backend, clock):
    # a session that holds its window keeps turning over: every release is progress, so the
    # head keeps its place past max_wait_s (30 s) and ages only once 30 s pass without any
    g = mkgate(backend, clock, headroom=1.0, max_wait_s=30, idle_grace_s=600, wait_poll_s=20)
    g.write_snapshot(engines(cap=1000, usage=0.1))
    g.acquire("busy", prompt_tokens=900, max_new_tokens=0).release()
    assert wait_call(g, "t", "new")["o"] == "wait"
    for _ in range(6):  # 60 s of turns of "busy", one every 10 s
        clock.advance(10)
        g.write_snapshot(engines(cap=1000, usage=0.1))
        g.acquire("busy", prompt_tokens=900, max_new_tokens=0).release()
        assert wait_call(g, "t", "new")["o"] == "wait"
    clock.advance(29)
    g.write_snapshot(engines(cap=1000, usage=0.1))  # a snapshot write is not progress
    assert wait_call(g, "t", "new")["o"] == "wait"
    clock.advance(1)
    r = wait_call(g, "t", "new")
    assert (r["o"], r["r"], r["w"]) == ("admit", "aged", 90000)
    assert stat(g, "admit_aged") == 1


def test_the_head_ages_after_max_wait_hard_s_whatever_the_progress(backend, clock):
    g = mkgate(backend, clock, headroom=1.0, max_wait_s=30, max_wait_hard_s=100, idle_grace_s=600,
               wait_poll_s=20)
    g.write_snapshot(engines(cap=1000, usage=0.1))
    g.acquire("busy", prompt_tokens=900, max_new_tokens=0).release()
    assert wait_call(g, "t", "new")["o"] == "wait"
    for _ in range(9):
        clock.advance(11)
        g.write_snapshot(engines(cap=1000, usage=0.1))
        g.acquire("busy", prompt_tokens=900, max_new_tokens=0).release()
        assert wait_call(g, "t", "new")["o"] == "wait"
    clock.advance(1)  # 100 s
    g.write_snapshot(engines(cap=1000, usage=0.1))
    r = wait_call(g, "t", "new")
    assert (r["o"], r["r"], r["w"]) == ("admit", "aged", 100000)


def test_only_the_head_ages_and_an_aged_admission_is_not_progress(backend, clock):
    g = mkgate(backend, clock, headroom=1.0, max_wait_s=30, idle_grace_s=600, wait_poll_s=30)
    g.write_snapshot(engines(cap=1000, usage=0.1))
    busy = g.acquire("busy", prompt_tokens=900, max_new_tokens=0)  # held: nothing to evict
    assert wait_call(g, "first", "s1")["o"] == "wait"
    clock.advance(5)
    assert wait_call(g, "second", "s2")["o"] == "wait"
    clock.advance(40)  # 45 s without progress: both are past 30 s, only the head may age
    g.write_snapshot(engines(cap=1000, usage=0.1))
    r = wait_call(g, "second", "s2")
    assert (r["o"], r["pos"]) == ("wait", 1)
    assert (wait_call(g, "first", "s1")["r"]) == "aged"
    # the aged admission reset nothing: the new head has waited 40 s without progress
    r = wait_call(g, "second", "s2")
    assert (r["o"], r["r"]) == ("admit", "aged")
    # a release is progress: a third waiter now waits its own 30 s
    script(g, "release", ticket="first")
    assert wait_call(g, "third", "s3")["o"] == "wait"
    busy.release()
    clock.advance(29)
    g.write_snapshot(engines(cap=1000, usage=0.1))
    assert wait_call(g, "third", "s3")["o"] == "wait"


def test_a_turn_larger_than_the_ceiling_enters_once_nothing_is_charged(backend, clock):
    # else it could enter only by aging, which waits max_wait_hard_s while other turns flow
    g = mkgate(backend, clock, headroom=0.5, max_wait_s=30, idle_grace_s=0)
    g.write_snapshot(engines(cap=1000, usage=0.1))  # ceiling 500
    small = g.acquire("small", prompt_tokens=100, max_new_tokens=0)
    assert wait_call(g, "big", "big", need=800)["r"] == "capacity_exhausted"
    small.release()
    r = wait_call(g, "big", "big", need=800)
    assert (r["o"], r["r"]) == ("admit", "open")
    assert ledger(g) == 800


# -- the budget scale (docs/budget.md) -----------------------------------------------------
def test_the_measured_budget_scale_sets_the_ceiling_while_fresh(backend, clock):
    g = mkgate(backend, clock, headroom=0.5, staleness_s=6.0)
    g.write_snapshot(engines(cap=1000, usage=0.1))
    assert g.status()["ceiling"] == 500
    g.write_snapshot(engines(cap=1000, usage=0.1), budget_scale=3.0)
    st = g.status()
    assert (st["ceiling"], st["budget_scale"]) == (1500, 3.0)
    assert g.acquire("a", prompt_tokens=1400, max_new_tokens=0).reason == "open"
    # a snapshot without a measured scale keeps the last one until it is stale
    clock.advance(5)
    g.write_snapshot(engines(cap=1000, usage=0.1))
    assert g.status()["ceiling"] == 1500
    clock.advance(1.5)
    g.write_snapshot(engines(cap=1000, usage=0.1))
    assert (g.status()["ceiling"], g.status()["budget_scale"]) == (500, 1.0)  # the ledger of the seeds


def test_a_fixed_budget_scale_overrides_the_measured_one(backend, clock):
    g = mkgate(backend, clock, headroom=0.5, budget_scale=1.0)
    g.write_snapshot(engines(cap=1000, usage=0.1), budget_scale=3.0)
    assert (g.status()["ceiling"], g.status()["budget_scale"]) == (500, 1.0)


def test_waiter_is_granted_when_a_lease_is_released(backend):
    g = mkgate(backend, headroom=1.0, residency=False, **LONG_POLL)
    g.write_snapshot(engines(cap=100))
    first = g.acquire("a", prompt_tokens=80, max_new_tokens=0)
    result = {}
    g2 = ParkingGate(backend(), gate="g1", config=kvgate.GateConfig(**{**FAST, "headroom": 1.0,
                                                                         "residency": False, **LONG_POLL}))

    def waiter():
        result["lease"] = g2.acquire("b", prompt_tokens=50, max_new_tokens=0)

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    g2.parked()  # enqueued, subscribed, and asleep until a message or its 60 s poll
    assert g.redis.zcard(g.key("fifo")) == 1
    t0 = time.monotonic()
    first.release()
    t.join(timeout=WAKE_S + 10)
    assert not t.is_alive()
    g2.close()
    lease = result["lease"]
    assert (lease.outcome, lease.reason) == ("admit", "open") and lease.waited_s > 0
    assert time.monotonic() - t0 < WAKE_S  # woken by pub/sub: its own poll is 60 s away
    m = g.step_metrics()
    assert m["agentic_kv/admission/wait_seconds_mean"] > 0


def test_abort_event_cancels_a_waiter(backend):
    g = mkgate(backend, max_wait_s=10.0, wait_poll_s=5.0)
    g.write_snapshot(engines(usage=0.95))
    ev = threading.Event()
    threading.Timer(0.3, ev.set).start()
    with pytest.raises(kvgate.AdmissionCancelled):
        g.acquire("s", prompt_tokens=1, max_new_tokens=1, abort_event=ev)
    assert g.redis.zcard(g.key("fifo")) == 0
    assert g.step_metrics()["agentic_kv/admission/cancelled"] == 1


def test_timeout_cancels_a_waiter(backend):
    g = mkgate(backend, max_wait_s=10.0, wait_poll_s=0.1)
    g.write_snapshot(engines(usage=0.95))
    with pytest.raises(kvgate.AdmissionTimeout):
        g.acquire("s", prompt_tokens=1, max_new_tokens=1, timeout_s=0.3)
    assert g.redis.zcard(g.key("fifo")) == 0 and g.redis.hlen(g.key("waiters")) == 0


def test_cancel_after_grant_releases_the_lease(backend, clock):
    g = mkgate(backend, clock, headroom=1.0, residency=False)
    g.write_snapshot(engines(cap=100))
    script(g, "acquire", ticket="a", session="a", need=100, probe=-2)
    assert script(g, "acquire", ticket="b", session="b", need=50, probe=-2)["o"] == "wait"
    script(g, "release", ticket="a")  # grants b while its caller is being cancelled
    assert ledger(g) == 50
    assert script(g, "cancel", ticket="b")["removed"] == "lease"
    assert ledger(g) == 0


# -- scripts survive SCRIPT FLUSH ------------------------------------------------------------
def test_noscript_recovery(backend, clock):
    g = mkgate(backend, clock)
    g.write_snapshot(engines())
    g.redis.script_flush()
    lease = g.acquire("s", prompt_tokens=1, max_new_tokens=1)
    assert lease.reason == "open"
    g.redis.script_flush()
    assert lease.release() is True


# -- asyncio ----------------------------------------------------------------------------------
@pytest.mark.redis_real
def test_async_turn_window_and_cancel(redis_url):
    async def main():
        cfg = kvgate.GateConfig(**{**FAST, "max_wait_s": 10.0, "wait_poll_s": 5.0})
        g = kvgate.AsyncGate.from_url(redis_url, gate="ag", config=cfg, probe=FakeProbe({"hot": 0.99}))
        await g.write_snapshot(engines(usage=0.88))
        async with g.turn("hot", prompt_ids=[1] * 10, max_new_tokens=5) as lease:
            assert lease.reason == "resident_prefix"
        async with g.turn("hot", prompt_ids=[1] * 12, max_new_tokens=5) as lease:
            assert lease.reason == "reserved_session"
        task = asyncio.create_task(g.acquire("cold", prompt_ids=[2] * 10, max_new_tokens=5))
        for _ in range(200):
            if await g.redis.zcard(g.key("fifo")):
                break
            await asyncio.sleep(0.01)
        assert await g.redis.zcard(g.key("fifo")) == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await g.redis.zcard(g.key("fifo")) == 0
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(g.acquire("cold", prompt_ids=[2] * 10, max_new_tokens=5), 0.3)
        assert await g.redis.zcard(g.key("fifo")) == 0
        out = await g.finish_session("hot")
        assert out["window"] == 1
        m = await g.step_metrics()
        assert m["agentic_kv/admission/cancelled"] == 2
        assert m["agentic_kv/admission/admit_reserved_session"] == 1
        st = await g.status()
        assert st["reserved"] == 0 and st["waiting"] == 0
        await g.aclose()

    asyncio.run(main())


# -- windows with admission on: the ledger charges sessions between turns ------------------
def test_open_admission_opens_a_window_when_admission_is_on(backend, clock):
    g = mkgate(backend, clock, idle_grace_s=30)
    g.write_snapshot(engines(usage=0.1))
    lease = g.acquire("s", prompt_tokens=100, max_new_tokens=20)
    assert lease.reason == "open"
    lease.release()
    assert ledger(g) == 120 and g.redis.hexists(g.key("windows"), "s")  # idle, still charged
    nxt = g.acquire("s", prompt_tokens=150, max_new_tokens=20)
    assert nxt.reason == "reserved_session" and ledger(g) == 170
    nxt.release()
    g.finish_session("s")
    assert ledger(g) == 0


def test_residency_alone_opens_windows_only_under_pressure(backend, clock):
    g = mkgate(backend, clock, admission=False)
    g.write_snapshot(engines(usage=0.1))
    g.acquire("s", prompt_tokens=100, max_new_tokens=20).release()
    assert ledger(g) == 0 and not g.redis.hexists(g.key("windows"), "s")


def test_over_committed_ledger_revokes_the_longest_idle_windows_first(backend, clock):
    # no engine measures its prefill cost here: the trim ends the longest idle first.
    # four windows opened a (oldest), b, c, d (youngest); released c, then d, then b: the
    # longest idle (c) is neither the youngest (d) nor the first by name (b)
    g = mkgate(backend, clock, headroom=1.0, idle_grace_s=60)
    g.write_snapshot(engines(cap=1000, usage=0.1))
    held = {sid: g.acquire(sid, prompt_tokens=200, max_new_tokens=0) for sid in ("a", "b", "c", "d")}
    for sid in ("a", "c", "d", "b"):
        held[sid].release()
        clock.advance(1)
    g.write_snapshot(engines(cap=1000, usage=0.1))
    assert ledger(g) == 800
    grow = g.acquire("a", prompt_tokens=500, max_new_tokens=0)  # rule 5 grows: 1100 > 1000
    assert grow.reason == "reserved_session"
    windows = {k.decode() for k in g.redis.hkeys(g.key("windows"))}
    assert windows == {"a", "b", "d"}  # c, idle the longest, ended at once
    assert ledger(g) == 900
    assert stat(g, "window_revoked") == 1
    # c's next turn now waits behind the ceiling in the FIFO
    r = script(g, "acquire", ticket="c2", session="c", need=300, probe=-2, retain=1)
    assert (r["o"], r["r"]) == ("wait", "capacity_exhausted")
    script(g, "cancel", ticket="c2")
    # more growth: the next longest idle goes (d), not the youngest-named or the oldest
    grow.release()
    g.acquire("a", prompt_tokens=800, max_new_tokens=0).release()  # 800 + 400 > 1000
    assert {k.decode() for k in g.redis.hkeys(g.key("windows"))} == {"a", "b"}
    assert ledger(g) == 1000


@pytest.mark.parametrize("s_per_token, fifo_wait_s, ended", [
    (1e-6, 0, "c"),   # cheap prefill: the largest idle window sends the fewest sessions back
    (1e-2, 0, "b"),   # dear: the longest idle, whose blocks the engines' LRU evicts anyway
    (1e-3, 0, "b"),   # c's 400 ms of re-prefill against a 1 ms wait: c stays
    (1e-3, 10, "c"),  # the FIFO's turns wait 10 s: a queued session costs more than c's prefill
])
def test_trim_ends_the_idle_window_that_frees_most_room_per_cost(backend, clock, s_per_token, fifo_wait_s,
                                                                 ended):
    g = mkgate(backend, clock, headroom=1.0, idle_grace_s=600, max_wait_s=30)
    snap = priced(engines(cap=1000, usage=0.1), s_per_token)
    g.write_snapshot(snap)
    if fifo_wait_s:  # one turn waits fifo_wait_s in the FIFO, then is granted
        full = g.acquire("x", prompt_tokens=1000, max_new_tokens=0)
        r = script(g, "acquire", ticket="w", session="w", need=100, probe=-2, retain=1)
        assert (r["o"], r["r"]) == ("wait", "capacity_exhausted")
        for _ in range(fifo_wait_s):  # it polls once a second; the poller keeps the snapshot fresh
            clock.advance(1)
            g.write_snapshot(snap)
            assert script(g, "acquire", ticket="w", session="w", need=100, probe=-2, retain=1)["o"] == "wait"
        full.release()
        g.finish_session("x")
        assert script(g, "acquire", ticket="w", session="w", need=100, probe=-2, retain=1)["o"] == "admit"
        script(g, "release", ticket="w")
        g.finish_session("w")
        assert stat(g, "wait_granted") == 1 and stat(g, "wait_ms_sum") == fifo_wait_s * 1000
    assert ledger(g) == 0
    # a (the oldest window, which always stays), then b, c, d; idle the longest: b
    size = {"a": 100, "b": 100, "c": 400, "d": 100}
    held = {sid: g.acquire(sid, prompt_tokens=n, max_new_tokens=0) for sid, n in size.items()}
    for sid in "abcd":
        held[sid].release()
        clock.advance(1)
    g.write_snapshot(snap)
    assert ledger(g) == 700
    # a grows to 500 tokens: 1100 on a 1000-token pool, 100 past the ceiling. The LRU would
    # evict b's 100 tokens, the longest idle, whichever window the gate ends
    g.acquire("a", prompt_tokens=500, max_new_tokens=0).release()
    assert {k.decode() for k in g.redis.hkeys(g.key("windows"))} == {"a", "b", "c", "d"} - {ended}
    assert stat(g, "window_revoked") == 1


def test_trim_ends_idle_windows_before_marking_held_ones(backend, clock):
    # the youngest window is held by a running turn: an idle older one is revoked instead
    g = mkgate(backend, clock, headroom=1.0, idle_grace_s=60)
    g.write_snapshot(engines(cap=1000, usage=0.1))
    for sid in ("a", "b"):
        g.acquire(sid, prompt_tokens=300, max_new_tokens=0).release()
    young = g.acquire("c", prompt_tokens=300, max_new_tokens=0)  # held
    grow = g.acquire("a", prompt_tokens=500, max_new_tokens=0)  # 1100 > 1000
    assert grow.reason == "reserved_session"
    assert {k.decode() for k in g.redis.hkeys(g.key("windows"))} == {"a", "c"}  # b ended
    assert "rv" not in json.loads(g.redis.hget(g.key("windows"), "c"))  # c is not marked
    assert ledger(g) == 800
    young.release()
    grow.release()
    assert ledger(g) == 800  # both idle, still charged


def test_held_window_revoked_ends_at_release(backend, clock):
    g = mkgate(backend, clock, headroom=1.0)
    g.write_snapshot(engines(cap=1000, usage=0.1))
    g.acquire("old", prompt_tokens=300, max_new_tokens=0).release()
    young = g.acquire("young", prompt_tokens=300, max_new_tokens=0)  # held
    grow = g.acquire("old", prompt_tokens=800, max_new_tokens=0)  # 1100 > 1000
    assert grow.reason == "reserved_session"
    assert g.redis.hexists(g.key("windows"), "young")  # held: marked, not ended yet
    young.release()  # ends instead of idling
    assert not g.redis.hexists(g.key("windows"), "young")
    assert ledger(g) == 800
    grow.release()
    assert ledger(g) == 800  # old's window idles, still charged


def test_a_budget_scale_lets_windows_outgrow_the_pool_before_the_trim(backend, clock):
    # budget scale 1.5 (fixed here; docs/budget.md): the growth that revokes a window above
    # (1100 tokens of windows on a 1000-token pool) revokes nobody
    g = mkgate(backend, clock, headroom=1.0, idle_grace_s=60, budget_scale=1.5)
    g.write_snapshot(engines(cap=1000, usage=0.1))
    for sid in ("old", "mid", "young"):
        g.acquire(sid, prompt_tokens=300, max_new_tokens=0).release()
        clock.advance(1)
    g.write_snapshot(engines(cap=1000, usage=0.1))
    grow = g.acquire("old", prompt_tokens=500, max_new_tokens=0)
    assert grow.reason == "reserved_session"
    grow.release()
    g.housekeep()
    assert {k.decode() for k in g.redis.hkeys(g.key("windows"))} == {"old", "mid", "young"}
    assert ledger(g) == 1100
    # the scaled ceiling (1500) admits newcomers too
    clock.advance(1)
    lease = g.acquire("new", prompt_tokens=100, max_new_tokens=0)
    assert (lease.outcome, lease.reason) == ("admit", "open")
    lease.release()
    assert ledger(g) == 1200
    # past 1.5x the pool the longest idle go (mid, released before young), down to the ceiling
    g.acquire("old", prompt_tokens=1000, max_new_tokens=0).release()  # 1700 > 1500
    assert {k.decode() for k in g.redis.hkeys(g.key("windows"))} == {"old", "young", "new"}
    assert ledger(g) == 1400
    assert stat(g, "window_revoked") == 1


def test_rule7_waits_when_the_ledger_is_full(backend, clock):
    g = mkgate(backend, clock, headroom=0.5, probe=FakeProbe({"hot": 1.0}), residency=True)
    g.write_snapshot(engines(cap=1000, usage=0.88))  # ceiling 500
    script(g, "acquire", ticket="big", session="big", need=450, probe=1.0, retain=1)  # resident, fits
    r = script(g, "acquire", ticket="t", session="hot", need=100, probe=1.0, retain=1)
    assert (r["o"], r["r"]) == ("wait", "capacity_exhausted")  # resident, but no room: it waits
    g2 = mkgate(backend, clock, headroom=0.5, admission=False, probe=FakeProbe({"hot": 1.0}))
    r = script(g2, "acquire", ticket="t2", session="hot2", need=100, probe=1.0, retain=1)
    assert (r["o"], r["r"]) == ("admit", "resident_prefix")  # residency alone: no ledger


def test_no_probe_when_the_ledger_has_no_room(backend, clock):
    # with admission on rule 7 needs ledger room: a full ledger makes any probe answer moot
    probe = FakeProbe(default=1.0)
    g = mkgate(backend, clock, headroom=0.5, probe=probe, max_wait_s=30)
    g.write_snapshot(engines(cap=1000, usage=0.88))  # ceiling 500, residency band
    script(g, "acquire", ticket="big", session="big", need=450, probe=1.0, retain=1)
    r = script(g, "acquire", ticket="t", session="hot", need=100, probe=-1, retain=1)
    assert (r["o"], r["r"]) == ("wait", "capacity_exhausted")  # not "probe"
    r = script(g, "acquire", ticket="t2", session="hot2", need=40, probe=-1, retain=1)
    assert r["o"] == "probe"  # 450 + 40 fits: a resident prefix could enter
    script(g, "cancel", ticket="t")
    script(g, "cancel", ticket="t2")
    assert probe.calls == []


def test_windows_may_grow_past_the_ceiling_until_capacity(backend, clock):
    g = mkgate(backend, clock, headroom=0.5, idle_grace_s=60)
    g.write_snapshot(engines(cap=1000, usage=0.1))  # ceiling 500, capacity 1000
    g.acquire("a", prompt_tokens=200, max_new_tokens=0).release()
    g.acquire("b", prompt_tokens=200, max_new_tokens=0).release()
    g.acquire("a", prompt_tokens=600, max_new_tokens=0).release()  # 800: over the ceiling, kept
    assert ledger(g) == 800 and g.redis.hlen(g.key("windows")) == 2
    r = script(g, "acquire", ticket="c", session="c", need=10, probe=-2, retain=1)
    assert (r["o"], r["r"]) == ("wait", "capacity_exhausted")  # newcomers wait
    script(g, "cancel", ticket="c")
    g.acquire("a", prompt_tokens=900, max_new_tokens=0).release()  # 1100 > capacity: trim
    assert {k.decode() for k in g.redis.hkeys(g.key("windows"))} == {"a"}  # b, younger, revoked
    assert ledger(g) == 900


def json_lease(gate, ticket):
    import json
    raw = gate.redis.hget(gate.key("leases"), ticket)
    assert raw is not None, f"no lease for {ticket}"
    return json.loads(raw)


def test_a_window_follows_a_shrinking_prompt(backend, clock):
    # the spec's reservation: a context reset shrinks the window's charge
    g = mkgate(backend, clock, idle_grace_s=60)
    g.write_snapshot(engines(cap=10_000, usage=0.1))
    g.acquire("s", prompt_tokens=800, max_new_tokens=0).release()
    assert ledger(g) == 800
    g.acquire("s", prompt_tokens=100, max_new_tokens=0).release()
    assert ledger(g) == 100


def test_residency_alone_opens_no_window_below_the_watermark_by_rule7(backend, clock):
    # residency without admission opens windows only under pressure (SPEC 4): a resident
    # prefix admitted past older waiters while usage is below high_watermark gets a lease only
    g = mkgate(backend, clock, admission=False, reap_batch=1)
    g.write_snapshot(engines(usage=0.9))
    for t in ("W1", "W2"):
        assert script(g, "acquire", ticket=t, session=t.lower(), need=10, probe=0.0, retain=1)["o"] == "wait"
    g.write_snapshot(engines(usage=0.8))  # grants one head (reap_batch 1); W2 still waits
    assert g.redis.zcard(g.key("fifo")) == 1
    r = script(g, "acquire", ticket="B", session="b", need=10, probe=1.0, retain=1)
    assert (r["o"], r["r"]) == ("admit", "resident_prefix")
    assert not g.redis.hexists(g.key("windows"), "b")
    # under pressure the same admission does open one
    g.write_snapshot(engines(usage=0.9))
    r = script(g, "acquire", ticket="C", session="c", need=10, probe=1.0, retain=1)
    assert (r["o"], r["r"]) == ("admit", "resident_prefix")
    assert g.redis.hexists(g.key("windows"), "c")


def test_a_waiter_ages_from_when_its_attempt_began(backend, clock):
    # a probe round trip before the attempt enqueued counts as waiting: its stall is measured
    # from when it began, as the caller's own deadline is
    g = mkgate(backend, clock)  # max_wait_s 2
    g.write_snapshot(engines(usage=0.88))
    r = script(g, "acquire", ticket="A", session="s", need=10, probe=-1)
    assert r["o"] == "probe"
    clock.advance(0.5)
    r = script(g, "acquire", ticket="A", session="s", need=10, probe=0.0, t0=r["b"])
    assert r["o"] == "wait" and r["w"] == 500
    clock.advance(1.0)  # (a re-check within the liveness deadline, as a polling caller does)
    assert script(g, "acquire", ticket="A", session="s", need=10, probe=-2)["o"] == "wait"
    clock.advance(0.6)  # 2.1 s since A began, 1.6 s since it enqueued
    r = script(g, "acquire", ticket="A", session="s", need=10, probe=-2)
    assert (r["o"], r["r"]) == ("admit", "aged")


# -- what the budget controller reads (kvgate/control/budget.py) ----------------------------
def counters(g) -> dict:
    names = ("acc_wait_ms", "acc_idle_ms", "n_released", "tok_fresh", "tok_reusable")
    return dict(zip(names, (int(v or 0) for v in g.redis.hmget(g.key("ledger"), *names))))


def test_the_scripts_integrate_waiting_and_idle_time(backend, clock):
    g = mkgate(backend, clock, headroom=1.0, wait_poll_s=30, idle_grace_s=600)
    g.write_snapshot(engines(cap=1000, usage=0.1))
    g.acquire("a", prompt_tokens=900, max_new_tokens=0).release()  # an idle window holds the ledger
    assert wait_call(g, "t", "new")["o"] == "wait"
    clock.advance(3)
    g.write_snapshot(engines(cap=1000, usage=0.1))  # 3 s waited, no turn in flight
    assert counters(g)["acc_wait_ms"] == 3000 and counters(g)["acc_idle_ms"] == 3000
    busy = g.acquire("a", prompt_tokens=900, max_new_tokens=0)  # a turn in flight now
    clock.advance(2)
    g.write_snapshot(engines(cap=1000, usage=0.1))
    assert counters(g)["acc_wait_ms"] == 5000 and counters(g)["acc_idle_ms"] == 3000
    busy.release()
    script(g, "cancel", ticket="t")
    clock.advance(4)  # nobody waits: neither counter moves
    g.write_snapshot(engines(cap=1000, usage=0.1))
    assert counters(g)["acc_wait_ms"] == 5000 and counters(g)["acc_idle_ms"] == 3000


def test_the_scripts_count_fresh_and_reusable_prompt_tokens(backend, clock):
    g = mkgate(backend, clock, idle_grace_s=600)
    g.write_snapshot(engines(cap=100_000, usage=0.1))
    g.acquire("s", prompt_tokens=100, max_new_tokens=10).release()
    assert (counters(g)["tok_fresh"], counters(g)["tok_reusable"]) == (100, 0)
    g.acquire("s", prompt_tokens=150, max_new_tokens=10).release()  # extends its last prompt, under its window
    assert (counters(g)["tok_fresh"], counters(g)["tok_reusable"]) == (150, 100)
    g.acquire("s", prompt_tokens=80, max_new_tokens=10).release()  # a reset context: all new
    assert (counters(g)["tok_fresh"], counters(g)["tok_reusable"]) == (230, 100)
    g.finish_session("s")
    g.acquire("s", prompt_tokens=200, max_new_tokens=10).release()  # no window to remember it by
    assert (counters(g)["tok_fresh"], counters(g)["tok_reusable"]) == (430, 100)
    assert counters(g)["n_released"] == 4


def test_a_session_whose_window_the_gate_ended_comes_back_to_fresh_tokens(backend, clock):
    # the re-prefill the controller reads is what the engines lost of what the gate held: a
    # session whose window was revoked (the trim) or whose grace expired comes back to a
    # prefill the gate chose, so its history counts as new, not as history the engines kept
    g = mkgate(backend, clock, headroom=1.0, idle_grace_s=60)
    g.write_snapshot(engines(cap=1000, usage=0.1))
    for sid in ("a", "b"):
        g.acquire(sid, prompt_tokens=300, max_new_tokens=0).release()
    clock.advance(1)
    g.acquire("a", prompt_tokens=400, max_new_tokens=0).release()  # a's window kept: 300 reusable
    assert (counters(g)["tok_fresh"], counters(g)["tok_reusable"]) == (700, 300)
    g.acquire("a", prompt_tokens=800, max_new_tokens=0).release()  # 800 + 300 > 1000: b revoked
    assert not g.redis.hexists(g.key("windows"), "b") and stat(g, "window_revoked") == 1
    assert (counters(g)["tok_fresh"], counters(g)["tok_reusable"]) == (1100, 700)
    g.acquire("a", prompt_tokens=100, max_new_tokens=0).release()  # a's reset context shrinks it
    g.acquire("b", prompt_tokens=350, max_new_tokens=0).release()  # extends b's 300, but cold
    assert (counters(g)["tok_fresh"], counters(g)["tok_reusable"]) == (1550, 700)
    clock.advance(61)  # b's grace expires
    g.write_snapshot(engines(cap=1000, usage=0.1))
    g.acquire("b", prompt_tokens=400, max_new_tokens=0).release()
    assert (counters(g)["tok_fresh"], counters(g)["tok_reusable"]) == (1950, 700)
    # without windows (residency off) the gate keeps no history charged, and the session's
    # last prompt is what the engines may still hold, as before
    g2 = mkgate(backend, clock, residency=False, gate="nowin")
    g2.write_snapshot(engines(cap=1000, usage=0.1))
    g2.acquire("s", prompt_tokens=100, max_new_tokens=0).release()
    g2.acquire("s", prompt_tokens=150, max_new_tokens=0).release()
    assert (counters(g2)["tok_fresh"], counters(g2)["tok_reusable"]) == (150, 100)
