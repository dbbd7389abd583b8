"""A session's attempts (SPEC 4): a newer attempt of a turn preempts the older one still
waiting and takes its FIFO place, whatever the newer one's own outcome (a protected or
degraded retry bypasses, and still ends the older attempt); an attempt back from its probe
round trip carries when it began (``t0``), for its place and for its age."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

import kvgate

from _gatehelpers import FAST, LONG_POLL, WAKE_S, Clock, engines, make_client, mkgate, script


def fifo(g) -> list[bytes]:
    return g.redis.zrange(g.key("fifo"), 0, -1)


# -- a newer attempt preempts the older one, and takes its place ----------------------------
def test_newer_attempt_preempts_older_waiting_one(backend):
    g = mkgate(backend, max_wait_s=10.0, wait_poll_s=5.0)
    g.write_snapshot(engines(usage=0.95))
    errors = []

    def old_attempt():
        g2 = mkgate(backend, max_wait_s=10.0, wait_poll_s=5.0)
        try:
            g2.acquire("s", prompt_tokens=1, max_new_tokens=1)
        except kvgate.Preempted as e:
            errors.append(e)
        g2.close()

    t = threading.Thread(target=old_attempt)
    t.start()
    deadline = time.monotonic() + 5
    while g.redis.zcard(g.key("fifo")) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    old_seq = g.redis.zrange(g.key("fifo"), 0, 0, withscores=True)[0][1]
    time.sleep(0.3)
    r = script(g, "acquire", ticket="new", session="s", need=2, probe=-2)
    assert r["o"] == "wait"
    t.join(timeout=8)
    assert not t.is_alive() and len(errors) == 1 and errors[0].reason == "preempted"
    assert g.num_preempted("s") == 1
    # the newer attempt inherited the older one's FIFO place
    assert g.redis.zscore(g.key("fifo"), "new") == old_seq
    assert g.finish_session("s")["num_preempted"] == 1
    assert g.num_preempted("s") == 0


@pytest.mark.redis_real
def test_async_preemption_and_grant(redis_url):
    async def until(pred, what: str, timeout: float = 20.0):
        """Poll ``pred`` (async) until truthy, bounded: a hang guard, not a timing claim."""
        deadline = time.monotonic() + timeout
        while not (v := await pred()):
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.01)
        return v

    async def main():
        cfg = kvgate.GateConfig(**{**FAST, **LONG_POLL, "residency": False, "headroom": 1.0})
        g = kvgate.AsyncGate.from_url(redis_url, gate="ag2", config=cfg)
        await g.write_snapshot(engines(cap=100))
        big = await g.acquire("a", prompt_tokens=100, max_new_tokens=0)
        old = asyncio.create_task(g.acquire("s", prompt_tokens=10, max_new_tokens=0))
        # the old attempt is in the FIFO, and this gate's listener is subscribed
        fifo = await until(lambda: g.redis.zrange(g.key("fifo"), 0, -1), "the old attempt to enqueue")
        assert len(fifo) == 1
        old_ticket = fifo[0]

        async def subscribed():
            return (await g.redis.pubsub_numsub(g.channel))[0][1] >= 1
        await until(subscribed, "the listener to subscribe")
        new = asyncio.create_task(g.acquire("s", prompt_tokens=10, max_new_tokens=0))
        with pytest.raises(kvgate.Preempted):
            await asyncio.wait_for(old, WAKE_S)  # woken by the preemption message, not its 60 s poll

        async def new_in_place():
            return await g.redis.zrange(g.key("fifo"), 0, -1) not in ([], [old_ticket])
        await until(new_in_place, "the new attempt to take the old one's place")
        t0 = time.monotonic()
        await big.release()
        lease = await asyncio.wait_for(new, WAKE_S + 10)
        assert time.monotonic() - t0 < WAKE_S  # woken by the grant, not by its 60 s poll
        assert (lease.reason, lease.tokens) == ("open", 10)
        assert await g.num_preempted("s") == 1
        await lease.release()
        await g.aclose()

    asyncio.run(main())


# -- a retry that bypasses ends the older attempt too -------------------------------------
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


def test_a_degraded_retry_preempts_the_waiting_attempt(backend, clock):
    g = mkgate(backend, clock, gate="pb", staleness_s=1.0, wait_poll_s=2.0)  # T1 stays alive meanwhile
    g.write_snapshot(engines(usage=0.95))
    assert script(g, "acquire", ticket="T1", session="s", need=10, probe=0.0)["o"] == "wait"
    clock.advance(1.5)  # past staleness_s: the next attempt bypasses as degraded
    assert g.redis.hexists(g.key("waiters"), "T1")
    r = script(g, "acquire", ticket="T2", session="s", need=10, probe=0.0)
    assert (r["o"], r["r"]) == ("bypass", "degraded")
    assert g.num_preempted("s") == 1
    assert script(g, "acquire", ticket="T1", session="s", need=10, probe=0.0)["o"] == "preempted"


def test_the_head_that_a_protected_retry_ends_lets_the_next_waiter_in(backend, clock):
    # T1 heads the FIFO and does not fit; X, behind it, would fit but waits (strict FIFO).
    # A protected retry of T1's session ends T1: X is granted at once, not at the next release
    g = mkgate(backend, clock, gate="pb", admission=True, residency=False)
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


# -- an attempt back from its probe round trip: its place and its age --------------------
def test_attempt_back_from_its_probe_does_not_preempt_a_newer_one(backend, clock):
    # A asks to probe (it has no FIFO record yet); meanwhile a newer attempt B of the same
    # session enqueues. A's next call must not take B for the older one (SPEC 4: the newer
    # attempt preempts the older): A is the one preempted, and B keeps its place.
    g = mkgate(backend, clock)
    g.write_snapshot(engines(usage=0.88))  # between the watermark and the guard: probes count
    r = script(g, "acquire", ticket="A", session="s", need=10, probe=-1)
    assert r["o"] == "probe" and "b" in r
    clock.advance(0.2)
    rb = script(g, "acquire", ticket="B", session="s", need=10, probe=-2)
    assert rb["o"] == "wait"
    clock.advance(0.2)
    ra = script(g, "acquire", ticket="A", session="s", need=10, probe=0.0, t0=r["b"])
    assert ra["o"] == "preempted"
    w = g.redis.hget(g.key("waiters"), "B")
    assert w is not None and b'"st":"w"' in w and g.redis.zscore(g.key("fifo"), "B") is not None
    assert g.num_preempted("s") == 1


def test_flow_sends_back_when_its_attempt_began(backend, clock):
    # the same through the client: a probe round trip carries the attempt's start as t0
    seen = []

    class Probe:
        def probe(self, session_id, prompt_ids):
            # while this attempt probes, a newer attempt of the session enqueues
            seen.append(script(g, "acquire", ticket="newer", session="s", need=5, probe=-2)["o"])
            return kvgate.ProbeResult(0.0)
    g = mkgate(backend, clock, probe=Probe())
    g.write_snapshot(engines(usage=0.88))
    with pytest.raises(kvgate.Preempted):
        g.acquire("s", prompt_ids=[1] * 4, max_new_tokens=1)
    assert seen == ["wait"] and g.redis.zscore(g.key("fifo"), "newer") is not None


def test_a_place_is_inherited_when_the_preempted_attempt_checks_in_while_the_new_one_probes(backend, clock):
    # T2 preempts the waiting T1 and goes to probe; T1's process learns it was preempted
    # (pub/sub is faster than a probe) before T2 comes back. T2 must still take T1's place,
    # ahead of X, who queued after T1 (SPEC 4: the newer attempt takes the older one's place)
    g = mkgate(backend, clock)
    g.write_snapshot(engines(usage=0.88))  # between the watermark and the guard: probes count
    assert script(g, "acquire", ticket="T1", session="s", need=10, probe=0.0)["o"] == "wait"
    t1_place = g.redis.zscore(g.key("fifo"), "T1")
    clock.advance(0.1)
    assert script(g, "acquire", ticket="X", session="x", need=10, probe=0.0)["o"] == "wait"
    clock.advance(0.1)
    r2 = script(g, "acquire", ticket="T2", session="s", need=10, probe=-1)
    assert r2["o"] == "probe"
    clock.advance(0.05)
    assert script(g, "acquire", ticket="T1", session="s", need=10, probe=-2)["o"] == "preempted"
    clock.advance(0.05)
    r2 = script(g, "acquire", ticket="T2", session="s", need=10, probe=0.0, t0=r2["b"])
    assert r2["o"] == "wait"
    assert g.redis.zscore(g.key("fifo"), "T2") == t1_place
    assert g.redis.zrange(g.key("fifo"), 0, -1) == [b"T2", b"X"]
    assert g.num_preempted("s") == 1


def test_a_new_attempt_back_from_its_probe_ages_from_when_it_began(backend, clock):
    g = mkgate(backend, clock, headroom=1.0, max_wait_s=0.3, admission=True)
    g.write_snapshot(engines(usage=0.88, cap=1000))  # between the watermark and the guard: T must probe
    r = script(g, "acquire", ticket="T", session="s", need=100, probe=-1, retain=1)
    assert r["o"] == "probe"
    clock.advance(0.5)  # a probe that took its whole timeout; max_wait_s (0.3 s) has passed
    r2 = script(g, "acquire", ticket="T", session="s", need=100, probe=0.1, retain=1, t0=r["b"])
    assert r2["o"] in ("admit", "bypass") and r2["r"] == "aged"  # not one more "wait" round trip

