"""How a gate calls its probe: a plain or async function is a probe (an async one for the
async gate only), anything else is refused; a probe runs in the gate's own bounded threads
(a hanging probe queues nothing behind it and leaves the event loop's default executor
free; a child of fork gets threads of its own); a probe that raises, whatever it raises, is
a failed probe (rule 8), while a cancellation of the turn itself still cancels it."""
from __future__ import annotations

import asyncio
import os
import sys
import threading
import time

import fakeredis
import pytest

import kvgate
from kvgate.client.flows import Probe
from kvgate.client.probe import PROBE_THREADS

from _gatehelpers import config, engines


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


def test_a_plain_function_is_a_probe(driver):
    calls = []

    def probe(session_id, prompt_ids):
        calls.append(session_id)
        return 0.95
    g = driver.gate(probe=probe, admission=False)
    assert g.probe is probe
    driver(g.write_snapshot(engines(usage=0.9)))  # above the watermark: the turn is probed
    lease = driver(g.acquire("s", prompt_ids=[1, 2, 3], max_new_tokens=4))
    assert (lease.outcome, lease.reason) == ("admit", "resident_prefix") and calls == ["s"]
    driver(lease.release())
    driver.close(g)


def test_an_async_function_is_a_probe_for_the_async_gate_only(driver):
    async def probe(session_id, prompt_ids):
        return 0.95
    if driver.kind == "sync":
        with pytest.raises(TypeError, match="async only"):
            driver.gate(probe=probe, admission=False)
        return
    g = driver.gate(probe=probe, admission=False)
    driver(g.write_snapshot(engines(usage=0.9)))
    assert driver(g.acquire("s", prompt_ids=[1, 2, 3], max_new_tokens=4)).reason == "resident_prefix"
    driver.close(g)


def test_what_is_not_a_probe_is_refused(driver):
    with pytest.raises(TypeError, match=r"probe must be an object with probe\(session_id, prompt_ids\)"):
        driver.gate(probe=0.9)
    g = driver.gate()
    with pytest.raises(TypeError, match="probe must be"):
        g.probe = "http://engine:8000"  # set later (examples/two_processes.py does): checked the same
    driver.close(g)


@pytest.mark.parametrize("exc", [SystemExit(3), GeneratorExit(), asyncio.CancelledError(), KeyboardInterrupt()])
def test_a_probe_raising_a_base_exception_is_a_failed_probe(exc):
    # raised in the probe's thread, so never an interrupt of the caller: fail open (rule 8)
    class Raising:
        def probe(self, session_id, prompt_ids):
            raise exc

    g = kvgate.Gate(fakeredis.FakeRedis(), gate="bx", probe=Raising(), config=config(admission=False))
    g.write_snapshot(engines(usage=0.9))
    lease = g.acquire("s", prompt_ids=[1, 2, 3], max_new_tokens=4)
    assert (lease.outcome, lease.reason) == ("admit", "prefix_probe_unavailable")
    lease.release()
    g.close()


@pytest.mark.skipif(not hasattr(os, "fork") or sys.platform == "darwin", reason="needs os.fork")
def test_a_child_of_fork_gets_its_own_probe_threads():
    # the child inherited a pool that believed it had an idle thread: its first probes queued
    # behind a thread that does not exist, and timed out
    class Quick:
        def probe(self, session_id, prompt_ids):
            return kvgate.ProbeResult(1.0)

    g = kvgate.Gate(fakeredis.FakeRedis(), gate="fk", probe=Quick(), config=config(admission=False, probe_timeout_s=2.0))
    g.write_snapshot(engines(usage=0.9))
    g.acquire("p", prompt_ids=[1, 2, 3], max_new_tokens=4).release()  # the parent's pool exists
    pid = os.fork()
    if pid == 0:  # the child: report by exit code only
        code = 1
        try:
            lease = g.acquire("c", prompt_ids=[1, 2, 3], max_new_tokens=4)
            code = 0 if lease.reason == "resident_prefix" else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    g.close()


def test_hanging_sync_probes_do_not_take_the_loops_default_executor():
    # redis-py's asyncio client resolves host names in the loop's default executor; probes that
    # hang there starved it, and every new Redis connection then timed out (degraded turns)
    probe = HangingProbe()

    async def main():
        g = kvgate.AsyncGate(fakeredis.FakeAsyncRedis(), gate="hp", probe=probe,
                             config=config(admission=False, probe_timeout_s=0.1))
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
                             config=config(admission=False))
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
                             config=config(admission=False, probe_timeout_s=60.0))
        await g.write_snapshot(engines(usage=0.9))
        t = asyncio.ensure_future(g.acquire("s", prompt_ids=[1, 2, 3], max_new_tokens=4))
        await asyncio.wait_for(started.wait(), 20)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        assert await g.redis.hlen(g.key("leases")) == 0
        await g.aclose()

    asyncio.run(main())


def test_hanging_probe_does_not_queue_without_bound():
    p = HangingProbe()
    g = kvgate.Gate(fakeredis.FakeRedis(), gate="g", config=kvgate.GateConfig(probe_timeout_s=0.05), probe=p)
    try:
        results = [g._probe(Probe(f"s{i}", [1] * 4))
                   for i in range(PROBE_THREADS + 6)]
        assert all(r.hit_ratio is None for r in results)
        assert p.calls == PROBE_THREADS  # the rest answered "busy" at once, nothing queued
        assert "busy" in results[-1].detail
    finally:
        p.release.set()
    deadline = time.monotonic() + 5
    while g._probe_threads.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert g._probe_threads.running == 0
    g.close()
