"""The asyncio gate keeps its bounds where a review found it did not: its own probe threads,
a deadline on every Redis call of finish_session, give-backs that aclose() waits for, a probe
that raises CancelledError failing open, and a gate used from a second event loop."""
from __future__ import annotations

import asyncio
import threading
import time

import fakeredis
import pytest
import redis
import redis.asyncio as aioredis

import kvgate
from kvgate.client.probe import PROBE_THREADS

from _gatehelpers import engines


#: a Redis stall (CLIENT PAUSE ... ALL; CLIENT UNPAUSE waits behind it too, so it just ends)
PAUSE_MS = 9000


def cfg(**kw) -> kvgate.GateConfig:
    return kvgate.GateConfig(**{"wait_poll_s": 0.2, "max_wait_s": 30.0, **kw})


class HangingProbe:
    """A blocking probe that hangs until released (a probe stuck past its timeout)."""

    def __init__(self):
        self.release = threading.Event()
        self.calls = 0
        self._lock = threading.Lock()

    def probe(self, session_id, prompt_ids):
        with self._lock:
            self.calls += 1
        self.release.wait(60)
        return kvgate.ProbeResult(1.0)


def test_hanging_sync_probes_do_not_take_the_loops_default_executor():
    # redis-py's asyncio client resolves host names in the loop's default executor; probes that
    # hang there starved it, and every new Redis connection then timed out (degraded turns)
    probe = HangingProbe()

    async def main():
        g = kvgate.AsyncGate(fakeredis.FakeAsyncRedis(), gate="hp", probe=probe,
                             config=cfg(admission=False, probe_timeout_s=0.1))
        await g.write_snapshot(engines(usage=0.9))  # residency under pressure: every turn probes
        leases = await asyncio.gather(*(g.acquire(f"s{i}", prompt_ids=[1, 2, 3], max_new_tokens=4)
                                        for i in range(PROBE_THREADS + 6)))
        # a failed probe with residency alone admits (rule 8); the busy ones answered at once
        assert {(ls.outcome, ls.reason) for ls in leases} == {("admit", "prefix_probe_unavailable")}
        assert probe.calls == PROBE_THREADS
        # the default executor is free: its work runs while the probes still hang
        assert await asyncio.wait_for(asyncio.to_thread(lambda: 42), 20) == 42
        for ls in leases:
            await ls.release()
        await g.aclose()

    try:
        asyncio.run(main())
    finally:
        probe.release.set()


def test_a_probe_that_raises_cancelled_error_fails_open():
    # the probe's own task was cancelled, not the turn's: a failed probe, not an exception in
    # the agent loop
    class CancelledProbe:
        async def aprobe(self, session_id, prompt_ids):
            raise asyncio.CancelledError("the probe's helper task was cancelled")

    async def main():
        g = kvgate.AsyncGate(fakeredis.FakeAsyncRedis(), gate="cp", probe=CancelledProbe(),
                             config=cfg(admission=False))
        await g.write_snapshot(engines(usage=0.9))
        lease = await g.acquire("s", prompt_ids=[1, 2, 3], max_new_tokens=4)
        assert (lease.outcome, lease.reason) == ("admit", "prefix_probe_unavailable")
        await lease.release()
        await g.aclose()

    asyncio.run(main())


def test_cancelling_the_turn_during_its_probe_still_cancels():
    # ... while a cancellation of the turn itself goes on as before
    started = None

    class SlowProbe:
        async def aprobe(self, session_id, prompt_ids):
            started.set()
            await asyncio.sleep(30)

    async def main():
        nonlocal started
        started = asyncio.Event()
        g = kvgate.AsyncGate(fakeredis.FakeAsyncRedis(), gate="cp2", probe=SlowProbe(),
                             config=cfg(admission=False, probe_timeout_s=60.0))
        await g.write_snapshot(engines(usage=0.9))
        t = asyncio.ensure_future(g.acquire("s", prompt_ids=[1, 2, 3], max_new_tokens=4))
        await asyncio.wait_for(started.wait(), 20)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        assert await g.redis.hlen(g.key("leases")) == 0
        await g.aclose()

    asyncio.run(main())


def test_finish_session_is_bounded_when_redis_stalls(redis_url):
    # engine_urls() and record_close() used the client directly, with no deadline and past an
    # open breaker: a stalled Redis held finish_session for as long as the stall
    admin = redis.Redis.from_url(redis_url)

    async def main():
        client = aioredis.Redis.from_url(redis_url, socket_timeout=60)  # a long timeout of its own
        g = kvgate.AsyncGate(client, gate="fs", config=cfg(session_lifecycle=True, redis_timeout_s=0.5))
        await g.write_snapshot(engines(usage=0.1))
        admin.execute_command("CLIENT", "PAUSE", str(PAUSE_MS), "ALL")
        t0 = time.monotonic()
        out = await asyncio.wait_for(g.finish_session("s"), 60)
        took = time.monotonic() - t0
        # the script call's deadline and the engine list's (1.5 s each; the counters skip Redis
        # past the open breaker); before, the rest of the stall (a bound that guards a hang,
        # with a wide margin, not a timing claim)
        assert took < PAUSE_MS / 1000 - 3, took
        # the engine list could not be read: a close that reached no engine, counted as failed
        assert "error" in out and out["close"] == {"attempts": 1, "failures": 1}
        await asyncio.sleep(PAUSE_MS / 1000 - took + 0.5)  # the pause is over
        await g.aclose()

    try:
        asyncio.run(main())
    finally:
        admin.close()


def test_num_preempted_is_bounded_when_redis_stalls(redis_url):
    admin = redis.Redis.from_url(redis_url)

    async def main():
        g = kvgate.AsyncGate(aioredis.Redis.from_url(redis_url, socket_timeout=60), gate="np",
                             config=cfg(redis_timeout_s=0.5))
        admin.execute_command("CLIENT", "PAUSE", str(PAUSE_MS), "ALL")
        t0 = time.monotonic()
        n = await asyncio.wait_for(g.num_preempted("s"), 60)
        took = time.monotonic() - t0
        assert n == 0 and took < PAUSE_MS / 1000 - 3, took
        await asyncio.sleep(PAUSE_MS / 1000 - took + 0.5)
        await g.aclose()

    try:
        asyncio.run(main())
    finally:
        admin.close()


def test_aclose_waits_for_a_release_still_in_flight(redis_url):
    # a caller cancelled while its shielded release runs moves on; aclose() closed the client
    # under that release, which was then deferred into a closed gate: the lease stayed charged
    # until lease_ttl_s
    admin = redis.Redis.from_url(redis_url)

    async def main():
        g = kvgate.AsyncGate.from_url(redis_url, gate="ac", config=cfg(redis_timeout_s=1.0))
        await g.write_snapshot(engines(usage=0.1))
        lease = await g.acquire("s", prompt_tokens=100, max_new_tokens=10)
        assert lease.outcome == "admit"
        assert int(admin.hlen(g.key("leases"))) == 1
        admin.execute_command("CLIENT", "PAUSE", "500", "ALL")  # the release is slow
        t = asyncio.ensure_future(lease.release())
        for _ in range(5):
            await asyncio.sleep(0)
        t.cancel()  # the caller gives up; the shielded release runs on
        await g.aclose()

    try:
        asyncio.run(main())
        # the lease is gone and the window it held is idle (its grace runs; it stays charged)
        assert admin.hlen("kvgate:{ac}:leases") == 0
        assert b'"h":0' in admin.hget("kvgate:{ac}:windows", "s")
    finally:
        admin.close()


def test_a_gate_used_from_a_second_event_loop_still_decides(redis_url):
    # two asyncio.run calls, or a gate at module scope under per-test loops: the first loop's
    # pooled connections raised RuntimeError ("Event loop is closed") into acquire
    g = kvgate.AsyncGate(aioredis.Redis.from_url(redis_url, socket_timeout=2), gate="tl", config=cfg())

    async def turn(sid):
        await g.write_snapshot(engines(usage=0.1))
        lease = await g.acquire(sid, prompt_tokens=100, max_new_tokens=10)
        await lease.release()
        return lease.outcome, lease.reason

    assert asyncio.run(turn("a")) == ("admit", "open")
    assert asyncio.run(turn("b")) == ("admit", "open")

    async def close():
        await g.aclose()
    asyncio.run(close())
