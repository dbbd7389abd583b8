"""The asyncio gate: a driver of the flows in ``flows.py`` that performs their operations
with asyncio I/O. Same surface as ``kvgate.Gate``; await what its methods return."""
from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, AsyncIterator, Callable, Generator

import redis.asyncio as aioredis

from . import access
from . import base as _base
from .base import GateBase, Lease, json_reply, script_step, ticket_to_wake, wait_step
from .flows import Eval, Probe, RedisDown, Run
from .lifecycle import CloseResult, aclose_session
from .probe import ProbeResult, ProbeThreads, coerce
from .._aio import wait_for
from .._urls import is_sentinel_url

__all__ = ["AsyncGate", "AsyncLease"]

# and the call deadline; and RuntimeError, which redis-py's asyncio client raises for a
# connection of another event loop ("attached to a different loop", "Event loop is closed")
REDIS_ERRORS = _base.REDIS_ERRORS + (asyncio.TimeoutError, RuntimeError)


async def _close_sentinels(client: Any) -> None:
    """Close the sentinels' connections of a client ``from_url`` built through Sentinel
    (redis-py's asyncio ``Sentinel`` has no close of its own)."""
    from redis.asyncio.sentinel import SentinelConnectionPool

    pool = getattr(client, "connection_pool", None)
    if isinstance(pool, SentinelConnectionPool):
        for s in pool.sentinel_manager.sentinels:
            with contextlib.suppress(Exception):
                await s.aclose()


class AsyncLease(Lease):
    """An admitted / bypassed / passed-through turn of an ``AsyncGate``: ``await
    lease.release()`` (idempotent, shielded from the caller's cancellation)."""


class AsyncGate(GateBase):
    """A gate for asyncio code; see ``kvgate.Gate`` for the semantics."""

    _lease_class = AsyncLease
    _blocking = False  # aprobe() is awaited; a blocking probe() runs on the gate's threads

    def __init__(self, redis_client: Any, gate: str, config: Any = None, probe: Any = None, clock_ms: Any = None):
        super().__init__(redis_client, gate, config, probe, clock_ms)
        self._listener = _AsyncListener(self)
        self._probe_threads = ProbeThreads()
        self._inflight: dict[str, set[asyncio.Task]] = {}
        self._givebacks: set[asyncio.Future] = set()  # shielded releases and cancels in flight
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop the client's connections belong to

    @staticmethod
    def _client_from_url(url: str, cluster: bool, kw: dict) -> Any:
        if is_sentinel_url(url):
            from redis.asyncio.retry import Retry
            from redis.asyncio.sentinel import Sentinel
            from redis.backoff import NoBackoff

            su = _base.sentinel_url(url, cluster)  # see Gate._client_from_url
            kw.setdefault("retry", Retry(NoBackoff(), 0))
            sentinel = Sentinel(su.sentinels, sentinel_kwargs={**_base._socket_kw(kw), **su.sentinel_kwargs})
            return sentinel.master_for(su.service, **{**kw, **su.master_kwargs})
        if cluster:
            from redis.asyncio.cluster import RedisCluster
            from redis.asyncio.retry import Retry
            from redis.backoff import NoBackoff

            kw.setdefault("retry", Retry(NoBackoff(), 0))  # see Gate._client_from_url
            return RedisCluster.from_url(url, **kw)
        return aioredis.Redis.from_url(url, **kw)

    async def aclose(self) -> None:
        """Wait (bounded) for releases and cancels still in flight, send what was deferred,
        then stop the listener and close the client; the last two also when cancelled."""
        try:
            pending = [t for t in self._givebacks if t.get_loop() is asyncio.get_running_loop()]
            if pending:
                # a twice-cancelled caller left its shielded give-back running: closing the
                # client under it would leave the lease charged until lease_ttl_s
                await asyncio.wait(pending, timeout=self._deadline_s())
            with contextlib.suppress(Exception):
                await self._run(self._flows.flush_at_close())
        finally:
            try:
                await self._listener.close()
            finally:
                self._probe_threads.shutdown()
                if self._owns_client:  # a client passed in is the caller's (see Gate.close)
                    with contextlib.suppress(Exception):
                        await self.redis.aclose()
                    await _close_sentinels(self.redis)

    async def __aenter__(self) -> "AsyncGate":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    # -- the driver --------------------------------------------------------------------------
    async def _run(self, flow: Generator, abort: Any = None, shield: bool = False,
                   then: Callable[[Any], Any] | None = None) -> Any:
        """Run a flow to its end, awaiting each operation it yields; ``shield``: the whole
        run goes on when the caller is cancelled (a release), and aclose() waits for it."""
        run = Run(flow, self._listener, abort)
        value = await (self._shielded(self._drive(run)) if shield else self._drive(run))
        return value if then is None else then(value)

    async def _drive(self, run: Run, rest: bool = False) -> Any:
        handed_off = False
        try:
            while (op := run.next()) is not Run.DONE:
                fn, args = run.handler(self, op)
                try:
                    run.send(await fn(*args))
                except BaseException as e:  # noqa: BLE001 - a fault or an interrupt goes into the flow
                    run.fail(e)
                    if run.interrupted is e and not rest:
                        # cancelled mid-call or mid-wait: the rest of the flow (it gives back
                        # what its ticket may hold) runs shielded, and aclose() waits for it
                        handed_off = True
                        with contextlib.suppress(BaseException):
                            await self._shielded(self._drive(run, rest=True))
                        raise
            return run.value
        finally:
            if not handed_off:  # else the shielded rest closes it when it ends
                run.close()

    async def _shielded(self, coro: Any) -> Any:
        """Run ``coro`` shielded from the caller's cancellation, where aclose() can wait for it."""
        t = asyncio.ensure_future(coro)
        self._givebacks.add(t)
        t.add_done_callback(self._givebacks.discard)
        return await asyncio.shield(t)

    def _bind_loop(self) -> None:
        """A gate used from a second event loop (two ``asyncio.run`` calls, a gate at module
        scope under per-test loops): the pooled connections belong to the first loop and
        would fail every call, so they are dropped and made anew on this one."""
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        if self._loop is not None:
            pool = getattr(self.redis, "connection_pool", None)
            if pool is not None and hasattr(pool, "reset"):
                with contextlib.suppress(Exception):
                    pool.reset()
        self._loop = loop

    async def _eval(self, op: Eval) -> dict:
        self._bind_loop()
        try:
            raw = await self._call_script(op)
        except (*REDIS_ERRORS, ValueError) as e:  # ValueError: a socket closed under the call
            if access.is_refusal(e):
                raise await self._refused(e) from e  # a configuration error, not a fault
            raise RedisDown(str(e) or type(e).__name__, e) from e
        return json_reply(raw)

    async def _call_script(self, op: Eval) -> Any:
        """See ``Gate._call_script``; each command within the call's deadline."""
        call = self._caller.call(op.script, self._keys, op.argv)
        done, out = script_step(call)
        while not done:
            try:
                reply, error = await wait_for(self._send_commands(out), self._deadline_s()), None
            except Exception as e:  # noqa: BLE001 - thrown into the call, which raises what it does not handle
                reply, error = None, e
            done, out = script_step(call, reply, error)
        return out

    async def _command(self, op: Any) -> Any:
        self._bind_loop()
        try:
            return await wait_for(self._send_commands(op), self._deadline_s())
        except REDIS_ERRORS as e:
            if access.is_refusal(e):
                raise await self._refused(e) from e
            raise RedisDown(str(e) or type(e).__name__, e) from e

    async def _refused(self, error: BaseException) -> RedisDown:
        """See ``Gate._refused``."""
        probe, replies = self._access_probe(error), None
        if probe is not None:
            with contextlib.suppress(*REDIS_ERRORS):
                replies = await wait_for(self._send_commands(probe, raise_on_error=False), self._deadline_s())
        return self._denied(error, probe, replies)

    async def _wait(self, ev: asyncio.Event, timeout_s: float, abort_event: Any) -> str:
        if self._listener.ensure_started():
            await asyncio.sleep(0)
            return "signal"
        waiters = [asyncio.ensure_future(ev.wait())]
        abort_is_async = isinstance(abort_event, asyncio.Event)
        if abort_is_async:
            if abort_event.is_set():
                waiters[0].cancel()
                return "abort"
            waiters.append(asyncio.ensure_future(abort_event.wait()))
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                step = wait_step(deadline, abort_event, poll_abort=abort_event is not None and not abort_is_async)
                if isinstance(step, str):
                    return step
                done, _ = await asyncio.wait(waiters, timeout=step, return_when=asyncio.FIRST_COMPLETED)
                if abort_event is not None and abort_event.is_set():
                    return "abort"
                if waiters[0] in done:
                    ev.clear()
                    return "signal"
        finally:
            for w in waiters:
                w.cancel()

    async def _probe(self, op: Probe) -> ProbeResult:
        probe = self._prober
        try:
            if callable(getattr(probe, "aprobe", None)):
                r = await wait_for(probe.aprobe(op.session_id, op.prompt_ids), self.config.probe_timeout_s)
            else:
                # on the gate's own bounded pool, not the loop's default executor (see
                # ProbeThreads); all threads busy answers unavailable at once
                fut = self._probe_threads.submit(probe.probe, op.session_id, op.prompt_ids)
                if isinstance(fut, ProbeResult):
                    return fut
                try:
                    r = await wait_for(asyncio.wrap_future(fut), self.config.probe_timeout_s)
                finally:
                    fut.cancel()  # not started yet: never runs; running: keeps its thread
            return coerce(r)
        except asyncio.CancelledError as e:
            task = asyncio.current_task()
            cancelling = getattr(task, "cancelling", None)  # Python 3.11+
            if cancelling is None or cancelling():
                raise  # this task is being cancelled: the caller's cancellation goes on
            # the probe's own work was cancelled, not this turn: a failed probe (fail open)
            return ProbeResult(None, detail=f"probe failed: CancelledError: {e}")
        except Exception as e:  # noqa: BLE001 - a failed probe is an unavailable probe
            return ProbeResult(None, detail=f"probe failed: {type(e).__name__}: {e}")

    async def _close_session(self, op: Any) -> CloseResult:
        return await aclose_session(op.urls, op.session_id, timeout_s=op.timeout_s)

    # -- turns in flight -------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def turn(self, session_id: str, **kw: Any) -> AsyncIterator[AsyncLease]:
        """``async with gate.turn(sid, prompt_ids=ids, max_new_tokens=n) as lease:`` wraps
        one engine call; the lease is released when the block exits, however it exits."""
        lease = await self.acquire(session_id, **kw)
        task = asyncio.current_task()
        if lease.outcome != "pass" and task is not None:
            self._inflight.setdefault(lease.session_id, set()).add(task)
        try:
            yield lease
        finally:
            if task is not None:
                s = self._inflight.get(lease.session_id)
                if s is not None:
                    s.discard(task)
                    if not s:
                        self._inflight.pop(lease.session_id, None)
            await lease.release()

    async def _join(self, session_id: str, timeout_s: float) -> tuple[int, int]:
        """Wait up to ``timeout_s`` for the session's turns in other tasks, then cancel those
        still running: (how many ended, how many were cancelled)."""
        me = asyncio.current_task()
        tasks = [t for t in self._inflight.get(session_id, ()) if t is not me and not t.done()]
        if not tasks:
            return 0, 0
        done, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for t in pending:
            t.cancel()
        return len(done), len(pending)


class _AsyncListener:
    """One pub/sub subscription per AsyncGate (one per process in practice)."""

    def __init__(self, gate: "AsyncGate"):
        self._gate = gate
        self._events: dict[str, asyncio.Event] = {}
        self._task: asyncio.Task | None = None
        self._closed = False  # set by close(): never subscribe again

    def register(self, ticket: str) -> asyncio.Event:
        ev = asyncio.Event()
        self._events[ticket] = ev
        return ev

    def unregister(self, ticket: str) -> None:
        self._events.pop(ticket, None)

    def ensure_started(self) -> bool:
        if self._task is not None and self._task.get_loop() is not asyncio.get_running_loop():
            self._task = None  # it belongs to an earlier event loop (maybe closed): start anew
        if self._closed or (self._task is not None and not self._task.done()):
            return False
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kvgate-pubsub")
        return True

    async def _run(self) -> None:
        backoff = 0.1
        while True:
            pubsub = None
            try:
                pubsub = self._gate.redis.pubsub(ignore_subscribe_messages=True)
                await pubsub.subscribe(self._gate.channel, self._gate.listen_channel)
                backoff = 0.1
                while True:
                    msg = await pubsub.get_message(timeout=1.0)
                    if msg is not None:
                        self._dispatch(msg)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - reconnect; waiters poll meanwhile
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
            finally:
                if pubsub is not None:
                    with contextlib.suppress(Exception):
                        await wait_for(pubsub.aclose(), 1.0)

    def _dispatch(self, msg: dict) -> None:
        ticket = ticket_to_wake(msg)
        ev = self._events.get(ticket) if ticket is not None else None
        if ev is not None:
            ev.set()

    async def close(self) -> None:
        self._closed = True  # before the await: a waiter must not start another task meanwhile
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(BaseException):
                await wait_for(task, 2.0)
