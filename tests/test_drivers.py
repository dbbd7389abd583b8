"""What the sync and the async gate must do alike: one test body runs over both drivers
(the ``d`` fixture), on fakeredis. The async gate's calls run on an event loop in a helper
thread, so the bodies read the same for both."""
from __future__ import annotations

import asyncio
import inspect
import threading
from concurrent.futures import Future

import fakeredis
import fakeredis.aioredis
import pytest

import kvgate
from _gatehelpers import engines

FAST = dict(wait_poll_s=0.2, max_wait_s=2.0, staleness_s=6.0)
TURN = dict(prompt_tokens=10, max_new_tokens=5)
NOWHERE = ("http://127.0.0.1:9",)  # nothing listens there: a close fails at once


class Driver:
    """Builds gates of one kind and runs their calls: ``d(gate.acquire(...))`` is the result
    for either kind (a coroutine is run on the helper loop)."""

    def __init__(self, kind: str):
        self.kind = kind
        self.server = fakeredis.FakeServer()
        self.loop: asyncio.AbstractEventLoop | None = None
        if kind == "async":
            self.loop = asyncio.new_event_loop()
            threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def gate(self, probe=None, **cfg):
        config = kvgate.GateConfig(**{**FAST, **cfg})
        if self.kind == "sync":
            return kvgate.Gate(fakeredis.FakeRedis(server=self.server), gate="d", config=config, probe=probe)
        return kvgate.AsyncGate(fakeredis.aioredis.FakeRedis(server=self.server), gate="d", config=config,
                                probe=probe)

    def __call__(self, value):
        if inspect.isawaitable(value):
            return asyncio.run_coroutine_threadsafe(_awaited(value), self.loop).result(30)
        return value

    def hold_turn(self, gate, session_id: str, until: threading.Event) -> Future:
        """A turn of the session in flight in another thread (or task) until ``until`` is set;
        its future answers "ended", or "cancelled" when the gate cancelled it."""
        entered = threading.Event()
        if self.kind == "sync":
            fut: Future = Future()

            def body():
                with gate.turn(session_id, **TURN):
                    entered.set()
                    until.wait(30)
                fut.set_result("ended")
            threading.Thread(target=body, daemon=True).start()
        else:
            async def abody():
                try:
                    async with gate.turn(session_id, **TURN):
                        entered.set()
                        while not until.is_set():
                            await asyncio.sleep(0.01)
                except asyncio.CancelledError:
                    return "cancelled"
                return "ended"
            fut = asyncio.run_coroutine_threadsafe(abody(), self.loop)
        assert entered.wait(10)
        return fut

    def close(self, gate) -> None:
        self(gate.close() if self.kind == "sync" else gate.aclose())
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.loop.stop)


async def _awaited(aw):
    return await aw


@pytest.fixture(params=["sync", "async"])
def d(request):
    return Driver(request.param)


def test_finish_session_joins_turns_that_end_and_aborts_the_rest(d):
    g = d.gate(session_lifecycle=True, close_timeout_s=0.5, engine_urls=NOWHERE)
    d(g.write_snapshot(engines()))
    ends = threading.Event()
    quick = d.hold_turn(g, "s", ends)
    threading.Timer(0.1, ends.set).start()
    out = d(g.finish_session("s"))
    assert (out["joined"], out["aborted"]) == (1, 0) and quick.result(10) == "ended"
    assert out["close"] == {"attempts": 1, "failures": 1}
    never = threading.Event()
    stuck = d.hold_turn(g, "t", never)
    out = d(g.finish_session("t"))
    assert (out["joined"], out["aborted"]) == (0, 1)
    if d.kind == "async":
        assert stuck.result(10) == "cancelled"  # its task was cancelled (the lease given back)
    else:
        assert not stuck.done()  # a thread cannot be stopped from outside: it goes on
        never.set()
        assert stuck.result(10) == "ended"
    assert int(d(g.redis.hlen(g.key("leases")))) == 0
    d.close(g)


def test_finish_session_inside_its_own_turn_does_not_wait_for_itself(d):
    g = d.gate(session_lifecycle=True, close_timeout_s=5.0, engine_urls=NOWHERE)
    d(g.write_snapshot(engines()))
    if d.kind == "sync":
        with g.turn("s", **TURN):
            out = g.finish_session("s")
    else:
        async def main():
            async with g.turn("s", **TURN):
                return await g.finish_session("s")
        out = d(main())
    assert (out["joined"], out["aborted"]) == (0, 0)
    d.close(g)


def test_a_plain_function_is_a_probe(d):
    calls = []

    def probe(session_id, prompt_ids):
        calls.append(session_id)
        return 0.95
    g = d.gate(probe=probe, admission=False)
    assert g.probe is probe
    d(g.write_snapshot(engines(usage=0.9)))  # above the watermark: the turn is probed
    lease = d(g.acquire("s", prompt_ids=[1, 2, 3], max_new_tokens=4))
    assert (lease.outcome, lease.reason) == ("admit", "resident_prefix") and calls == ["s"]
    d(lease.release())
    d.close(g)


def test_an_async_function_is_a_probe_for_the_async_gate_only(d):
    async def probe(session_id, prompt_ids):
        return 0.95
    if d.kind == "sync":
        with pytest.raises(TypeError, match="async only"):
            d.gate(probe=probe, admission=False)
        return
    g = d.gate(probe=probe, admission=False)
    d(g.write_snapshot(engines(usage=0.9)))
    assert d(g.acquire("s", prompt_ids=[1, 2, 3], max_new_tokens=4)).reason == "resident_prefix"
    d.close(g)


def test_what_is_not_a_probe_is_refused(d):
    with pytest.raises(TypeError, match=r"probe must be an object with probe\(session_id, prompt_ids\)"):
        d.gate(probe=0.9)
    g = d.gate()
    with pytest.raises(TypeError, match="probe must be"):
        g.probe = "http://engine:8000"  # set later (examples/two_processes.py does): checked the same
    d.close(g)


def test_max_new_tokens_is_required(d):
    g = d.gate()
    with pytest.raises(TypeError, match="max_new_tokens"):
        g.acquire("s", prompt_tokens=10)
    d.close(g)


def test_scope_words_and_their_errors(d):
    g = d.gate()  # gates train turns only
    d(g.write_snapshot(engines()))
    assert d(g.acquire("s", scope="eval", **TURN)).outcome == "pass"
    with pytest.raises(ValueError, match=r"'train' or 'eval'.*config scope, 'train' or 'all'"):
        d(g.acquire("s", scope="all", **TURN))
    with pytest.raises(ValueError, match="'train' or 'all'"):
        kvgate.GateConfig(scope="eval")
    everything = d.gate(scope="all")
    lease = d(everything.acquire("s", scope="eval", **TURN))
    assert lease.outcome == "admit"
    d(lease.release())
    d.close(g)


def test_redis_down_degrades_and_the_release_is_sent_later(d):
    g = d.gate()
    d(g.write_snapshot(engines()))
    lease = d(g.acquire("s", retain_session=False, **TURN))
    g._flows.trip()  # a fault elsewhere in this process
    assert d(g.acquire("t", **TURN)).reason == "degraded"
    assert d(lease.release()) is False and g.deferred_count == 1
    g._flows._breaker_until = float("-inf")
    d(g.step_metrics())
    assert g.deferred_count == 0 and int(d(g.redis.hlen(g.key("leases")))) == 0
    d.close(g)
