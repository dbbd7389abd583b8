"""Helpers for the gate tests: backends (fakeredis / real redis-server), a manual clock, the
gates most tests build, and the two drivers (sync / async) that let one test body run over
both gates (the ``driver`` fixture in tests/conftest.py)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
import threading
from typing import Any, Callable

import fakeredis
import fakeredis.aioredis
import pytest
import redis

import kvgate

#: short waits, so a test that waits does not wait long; a test that needs others says so
FAST = dict(wait_poll_s=0.2, max_wait_s=2.0, staleness_s=6.0)

#: a turn's size where the size does not matter
TURN = dict(prompt_tokens=10, max_new_tokens=5)

#: a poll this long tells a pub/sub wake-up (within WAKE_S) from the waiter's own re-check
LONG_POLL = dict(wait_poll_s=60.0, max_wait_s=120.0)
WAKE_S = 20.0

#: a call that takes longer than this is a hang (a bound that detects one, not a latency claim)
HANG_S = 10.0


class Clock:
    """An injected script clock in ms that tests advance by hand."""

    def __init__(self, start_ms: int = 1_700_000_000_000):
        self.ms = start_ms

    def __call__(self) -> int:
        return self.ms

    def advance(self, seconds: float) -> None:
        self.ms += int(seconds * 1000)


def engines(usage: float = 0.1, cap: int = 10_000, n: int = 1, healthy: bool = True):
    return [kvgate.EngineState(f"http://127.0.0.1:{9000 + i}", capacity_tokens=cap, usage=usage,
                               healthy=healthy, url=f"http://127.0.0.1:{9000 + i}") for i in range(n)]


def make_client(backend: str, url: str | None):
    if backend == "fake":
        return fakeredis.FakeRedis(server=fakeredis.FakeServer())
    return redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)


def config(**cfg) -> kvgate.GateConfig:
    """A GateConfig with FAST waits unless ``cfg`` says otherwise."""
    return kvgate.GateConfig(**{**FAST, **cfg})


def in_thread(fn: Callable, *args, **kw) -> concurrent.futures.Future:
    """``fn(*args, **kw)`` started in a thread of its own: its future."""
    ex = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:
        return ex.submit(fn, *args, **kw)
    finally:
        ex.shutdown(wait=False)


def result_within(fut: concurrent.futures.Future, timeout: float, what: str):
    """The future's result; the test fails if it is not done within ``timeout`` (a hang)."""
    done, _ = concurrent.futures.wait([fut], timeout=timeout)
    if not done:
        pytest.fail(f"{what} did not return within {timeout}s (hang)")
    return fut.result()  # (not result(timeout): AdmissionTimeout is a TimeoutError too)


def bounded(fn: Callable, *args, timeout: float = HANG_S, **kw):
    """Run ``fn`` in a thread; fail the test if it does not return within ``timeout`` (a hang
    detector, not a latency assertion)."""
    return result_within(in_thread(fn, *args, **kw), timeout, getattr(fn, "__name__", repr(fn)))


def mkgate(backend, clock=None, probe=None, gate: str = "g1", **cfg) -> kvgate.Gate:
    """A sync gate on a client that ``backend()`` makes (the ``backend`` fixture, or a client
    class such as fakeredis.FakeRedis), with FAST waits unless ``cfg`` says otherwise."""
    return kvgate.Gate(backend(), gate=gate, config=config(**cfg), probe=probe, clock_ms=clock)


def ledger(gate) -> int:
    """The tokens the ledger holds (a sync gate's client)."""
    return int(gate.redis.hget(gate.key("ledger"), "reserved") or 0)


def ledger_consistent(r: redis.Redis, g) -> int:
    """reserved == own charges of live leases + window charges, and never clamped (it never
    went negative); returns reserved."""
    reserved = int(r.hget(g.key("ledger"), "reserved") or 0)
    own = sum(json.loads(v)["t"] for v in r.hvals(g.key("leases")))
    win = sum(json.loads(v)["t"] for v in r.hvals(g.key("windows")))
    assert reserved == own + win, (reserved, own, win)
    assert int(r.hget(g.key("totals"), "ledger_clamped") or 0) == 0
    return reserved


def stat(gate, field: str) -> int:
    """One counter of the gate's current rollout step (a sync gate's client): its totals less
    their values when the step began (lua/drain_stats.lua)."""
    r = gate.redis
    return int(float(r.hget(gate.key("totals"), field) or 0) - float(r.hget(gate.key("stats"), field) or 0))


def script(gate: kvgate.Gate, name: str, **params) -> dict:
    """Call one script directly (one atomic transition), with the gate's knobs. The client
    always sends an acquire's ``prompt``, ``protected`` and ``retain`` (the script requires
    them); a test that leaves them out means a turn whose whole need is its prompt, not
    protected, that opens no window."""
    if name == "acquire":
        if "need" in params:
            params.setdefault("prompt", params["need"])
        params.setdefault("protected", 0)
        params.setdefault("retain", 0)
    return gate._eval(gate._flows.eval_op(name, params))


class Driver:
    """Builds gates of one kind, ``"sync"`` (kvgate.Gate) or ``"async"`` (kvgate.AsyncGate),
    and runs their calls, so one test body serves both: ``driver(gate.acquire(...))`` is the
    result for either kind. The async gate's calls run on an event loop in a helper thread, so
    a body may block (sleep, wait for a thread) the same way for both."""

    def __init__(self, kind: str):
        if kind not in ("sync", "async"):
            raise ValueError(f"kind is 'sync' or 'async', not {kind!r}")
        self.kind = kind
        self.server = fakeredis.FakeServer()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        if kind == "async":
            self.loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
            self._thread.start()

    def __repr__(self) -> str:
        return f"Driver({self.kind!r})"

    @property
    def gate_class(self) -> type:
        return kvgate.Gate if self.kind == "sync" else kvgate.AsyncGate

    # -- building gates -----------------------------------------------------------------------
    def client(self) -> Any:
        """A fakeredis client of this driver's kind on its one fake server."""
        if self.kind == "sync":
            return fakeredis.FakeRedis(server=self.server)
        return fakeredis.aioredis.FakeRedis(server=self.server)

    def gate(self, probe=None, gate: str = "d", clock=None, client=None, **cfg):
        """A gate on ``client`` (by default one on this driver's fake server), FAST waits
        unless ``cfg`` says otherwise."""
        return self.gate_class(client if client is not None else self.client(), gate=gate, config=config(**cfg),
                               probe=probe, clock_ms=clock)

    def from_url(self, url: str, gate: str, config: kvgate.GateConfig, **kw):
        return self.gate_class.from_url(url, gate=gate, config=config, **kw)

    # -- running calls ------------------------------------------------------------------------
    def __call__(self, value):
        """``value`` itself, or what it gives when awaited (on the helper loop)."""
        if inspect.isawaitable(value):
            return asyncio.run_coroutine_threadsafe(_awaited(value), self.loop).result(60)
        return value

    def start(self, fn: Callable, *args, **kw) -> concurrent.futures.Future:
        """Start ``fn(*args, **kw)`` elsewhere (a thread, or a task on the helper loop): its future."""
        if self.kind == "sync":
            return in_thread(fn, *args, **kw)

        async def run():
            return await fn(*args, **kw)
        return asyncio.run_coroutine_threadsafe(run(), self.loop)

    def call(self, fn: Callable, *args, timeout: float = HANG_S, **kw):
        """``fn(*args, **kw)``'s result; the test fails if it does not return within ``timeout``
        (a hang detector, not a latency assertion)."""
        return result_within(self.start(fn, *args, **kw), timeout, getattr(fn, "__name__", repr(fn)))

    def turn(self, gate, session_id: str, body: Callable = lambda lease: None, **kw):
        """One ``gate.turn(session_id, **kw)`` around ``body(lease)``: what the body returns
        (an awaitable it returns is awaited inside the async turn, so ``lambda lease:
        gate.finish_session(...)`` calls the gate from within its turn for both kinds). An
        async turn's body runs on the helper loop's thread."""
        if self.kind == "sync":
            with gate.turn(session_id, **kw) as lease:
                return body(lease)

        async def run():
            async with gate.turn(session_id, **kw) as lease:
                out = body(lease)
                return await out if inspect.isawaitable(out) else out
        return self(run())

    def hold_turn(self, gate, session_id: str, until: threading.Event) -> concurrent.futures.Future:
        """A turn of the session in flight in another thread (or task) until ``until`` is set;
        its future answers "ended", or "cancelled" when the gate cancelled it."""
        entered = threading.Event()
        if self.kind == "sync":
            fut: concurrent.futures.Future = concurrent.futures.Future()

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
        """Close a gate of this kind: close(), or aclose() (bounded)."""
        if self.kind == "sync":
            gate.close()
        else:
            self.call(gate.aclose)

    def stop(self) -> None:
        """Stop the helper loop (the fixture's teardown)."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            if not self._thread.is_alive():
                self.loop.close()


async def _awaited(aw):
    return await aw


class ParkingGate(kvgate.Gate):
    """A sync gate that records its acquire replies, so a test knows when a waiter on it is
    parked: its first call enqueues it, its second is the re-check right after its pub/sub
    listener subscribed; after that it sleeps on its event until a message names its ticket
    or a whole poll passes."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.replies: list[tuple[str, dict]] = []  # (ticket, reply)
        self._cv = threading.Condition()

    def _eval(self, op):
        r = super()._eval(op)
        if op.script == "acquire":
            with self._cv:
                self.replies.append((op.params["ticket"], r))
                self._cv.notify_all()
        return r

    def parked(self, timeout: float = 30.0) -> str:
        """Wait (bounded) until the waiter made its two calls, both answered "wait"; its ticket."""
        with self._cv:
            ok = self._cv.wait_for(lambda: len(self.replies) >= 2, timeout)
            replies = list(self.replies)
        assert ok, f"the waiter did not park within {timeout}s: {replies}"
        assert [r.get("o") for _, r in replies[:2]] == ["wait", "wait"], replies
        return replies[0][0]
