"""The asyncio gate: the same surface as ``kvgate.Gate``, for agent loops on asyncio."""
from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, AsyncIterator, Sequence

import redis.asyncio as aioredis

from . import base as _base
from .base import GateBase, LeaseBase, engine_urls_from
from .flows import BreakerOpen, Decision, Eval, Probe, RedisDown, TurnRequest, Wait, acquire_flow, check_session_id
from ..config import GateConfig
from ..errors import KvgateError
from .probe import UNAVAILABLE, ProbeResult, coerce
from .snapshot import EngineState, SnapshotResult
from .._aio import wait_for

# and the call deadline; and RuntimeError, which redis-py's asyncio client raises for a
# connection of another event loop ("attached to a different loop", "Event loop is closed")
REDIS_ERRORS = _base.REDIS_ERRORS + (asyncio.TimeoutError, RuntimeError)


class AsyncLease(LeaseBase):
    """An admitted / bypassed / passed-through turn. ``await lease.release()`` is idempotent."""

    async def release(self) -> bool:
        if not self._begin_release():
            return False
        # shielded: a cancelled caller still gives its lease back; aclose() waits for it
        return await self._gate._give_back(self._gate._release(self.ticket, time.monotonic() - self._t0,
                                                               self.turn_index))


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
                await pubsub.subscribe(self._gate.channel)
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
        data = msg.get("data")
        if isinstance(data, bytes):
            data = data.decode(errors="replace")
        if not isinstance(data, str) or " " not in data:
            return
        kind, arg = data.split(" ", 1)
        if kind in ("g", "p", "a"):  # granted, preempted, may age now: re-check
            ev = self._events.get(arg)
            if ev is not None:
                ev.set()

    async def close(self) -> None:
        self._closed = True  # before the await: a waiter must not start another task meanwhile
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(BaseException):
                await wait_for(task, 2.0)


class AsyncGate(GateBase):
    """A gate for asyncio code; see ``kvgate.Gate`` for the semantics."""

    def __init__(self, redis_client: Any, gate: str, config: GateConfig | None = None, probe: Any = None,
                 clock_ms: Any = None):
        super().__init__(gate, config, probe, clock_ms)
        self.redis = redis_client
        self._scripts = {n: redis_client.register_script(src) for n, src in self._sources.items()}
        self._listener = _AsyncListener(self)
        self._inflight: dict[str, set[asyncio.Task]] = {}
        self._givebacks: set[asyncio.Future] = set()  # shielded releases and cancels in flight
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop the client's connections belong to

    @classmethod
    def from_url(cls, url: str, gate: str, config: GateConfig | None = None, probe: Any = None,
                 cluster: bool = False, **redis_kwargs: Any) -> "AsyncGate":
        cfg = GateConfig.from_env() if config is None else config
        kw = dict(socket_connect_timeout=cfg.redis_timeout_s, socket_timeout=cfg.redis_timeout_s)
        kw.update(redis_kwargs)
        if cluster:
            from redis.asyncio.cluster import RedisCluster
            from redis.asyncio.retry import Retry
            from redis.backoff import NoBackoff

            kw.setdefault("retry", Retry(NoBackoff(), 0))  # see Gate.from_url
            client = RedisCluster.from_url(url, **kw)
        else:
            client = aioredis.Redis.from_url(url, **kw)
        g = cls(client, gate=gate, config=cfg, probe=probe)
        g._owns_client = True
        return g

    async def aclose(self) -> None:
        """Wait (bounded) for releases and cancels still in flight, send what was deferred,
        then stop the listener and close the client; the last two also when cancelled."""
        try:
            pending = [t for t in self._givebacks if t.get_loop() is asyncio.get_running_loop()]
            if pending:
                # a twice-cancelled caller left its shielded give-back running: closing the
                # client under it would leave the lease charged until lease_ttl_s
                await asyncio.wait(pending, timeout=self._deadline_s())
            await self._flush_at_close()
        finally:
            try:
                await self._listener.close()
            finally:
                self._shutdown_probe_pool()
                if self._owns_client:  # a client passed in is the caller's (see Gate.close)
                    with contextlib.suppress(Exception):
                        await self.redis.aclose()

    async def __aenter__(self) -> "AsyncGate":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def _flush_at_close(self) -> None:
        """See ``GateBase._close_flushes``."""
        with contextlib.suppress(Exception):
            for _ in range(self._close_flushes()):
                await self._flush_deferred()

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

    async def _give_back(self, coro: Any) -> Any:
        """Run a release or cancel shielded from the caller's cancellation, and keep it
        where aclose() can wait for it."""
        t = asyncio.ensure_future(coro)
        self._givebacks.add(t)
        t.add_done_callback(self._givebacks.discard)
        return await asyncio.shield(t)

    async def _plain(self, make: Any, breaker: bool = True) -> Any:
        """A plain Redis command outside the scripts (finish_session's engine URLs and close
        counters, num_preempted): skipped while the breaker is open (unless ``breaker`` is
        False), bounded by the call deadline, a fault trips the breaker. Raises RedisDown."""
        if breaker and self._breaker_open():
            raise BreakerOpen("breaker open after a recent Redis fault")
        self._bind_loop()
        try:
            return await wait_for(make(), self._deadline_s())
        except REDIS_ERRORS as e:
            self._trip()
            raise RedisDown(str(e) or type(e).__name__) from e

    async def _eval(self, name: str, params: dict) -> dict:
        if self._breaker_open():
            raise BreakerOpen("breaker open after a recent Redis fault")
        if self._deferred:
            await self._flush_deferred()
        return await self._call(name, params)

    async def _call(self, name: str, params: dict) -> dict:
        self._bind_loop()
        args = self._args(params)
        try:
            raw = await wait_for(self._scripts[name](keys=self._keys, args=args), self._deadline_s())
        except (*REDIS_ERRORS, ValueError) as e:  # ValueError: a socket closed under the call
            self._trip()
            raise RedisDown(str(e) or type(e).__name__) from e
        return self._decode(raw)

    async def _flush_deferred(self) -> None:
        """See ``Gate._flush_deferred``."""
        items = self._take_deferred()
        for i, (_, script, params) in enumerate(items):
            try:
                await self._call(script, params)
            except RedisDown as e:
                self._undo_take(items[i:])
                raise BreakerOpen(f"Redis faulted while sending deferred releases: {e}") from e
            except BaseException:  # cancelled mid-flush: keep what was not confirmed
                self._undo_take(items[i:])
                raise

    # -- turns -----------------------------------------------------------------------------
    async def acquire(self, session_id: str, *, prompt_ids: Sequence[int] | None = None,
                      prompt_tokens: int | None = None, max_new_tokens: int | None = None, protected: bool = False,
                      scope: str = "train", retain_session: bool = True, abort_event: Any = None,
                      turn_index: int | None = None, timeout_s: float | None = None) -> AsyncLease:
        """See ``Gate.acquire``. Cancelling the awaiting task removes its waiter atomically
        (a lease granted at that moment is released)."""
        if abort_event is not None and not hasattr(abort_event, "is_set"):
            raise ValueError("abort_event must be an Event (with is_set())")
        req = self._request(session_id, dict(prompt_ids=prompt_ids, prompt_tokens=prompt_tokens,
                                             max_new_tokens=max_new_tokens, protected=protected, scope=scope,
                                             retain_session=retain_session, turn_index=turn_index,
                                             timeout_s=timeout_s))
        d = await self._drive(req, abort_event)
        self._count_unseen(d)
        return AsyncLease(self, req, d)

    @contextlib.asynccontextmanager
    async def turn(self, session_id: str, **kw: Any) -> AsyncIterator[AsyncLease]:
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

    async def _drive(self, req: TurnRequest, abort_event: Any) -> Decision:
        gen = acquire_flow(self.config, req, self._knobs, self.probe is not None, time.monotonic)
        ev = self._listener.register(req.ticket)
        sent = False  # a script call for this ticket may have run
        send: Any = None
        throw: BaseException | None = None
        try:
            while True:
                try:
                    op = gen.throw(throw) if throw is not None else gen.send(send)
                except StopIteration as stop:
                    return stop.value
                send, throw = None, None
                if isinstance(op, Eval):
                    try:
                        send = await self._eval(op.script, op.params)
                    except RedisDown as e:
                        throw = e
                        sent = self._eval_failed(req.ticket, op.script, op.params, e, sent)
                    else:
                        sent = True
                elif isinstance(op, Probe):
                    send = await self._probe(req)
                elif isinstance(op, Wait):
                    send = await self._wait(ev, op.timeout_s, abort_event)
                else:  # pragma: no cover
                    raise AssertionError(op)
        except BaseException as e:
            if not isinstance(e, (KvgateError, ValueError)):
                # cancelled (asyncio.timeout, task.cancel) mid-call or mid-wait: remove the
                # waiter, or release a lease granted concurrently; shielded and bounded
                await self._cancel_shielded(req.ticket)
            raise
        finally:
            self._listener.unregister(req.ticket)
            gen.close()

    async def _cancel_shielded(self, ticket: str) -> None:
        async def cancel() -> None:
            try:
                await self._eval("cancel", {"ticket": ticket})
            except RedisDown:
                self._defer(ticket, "cancel", {"ticket": ticket})
        with contextlib.suppress(BaseException):
            await self._give_back(cancel())

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
                if abort_event is not None and abort_event.is_set():
                    return "abort"
                left = deadline - time.monotonic()
                if left <= 0:
                    return "timeout"
                step = left if (abort_event is None or abort_is_async) else min(left, 0.05)
                done, _ = await asyncio.wait(waiters, timeout=step, return_when=asyncio.FIRST_COMPLETED)
                if abort_event is not None and abort_event.is_set():
                    return "abort"
                if waiters[0] in done:
                    ev.clear()
                    return "signal"
        finally:
            for w in waiters:
                w.cancel()

    async def _probe(self, req: TurnRequest) -> ProbeResult:
        probe = self.probe
        if probe is None or req.prompt_ids is None:
            return UNAVAILABLE
        try:
            if hasattr(probe, "aprobe"):
                r = await wait_for(probe.aprobe(req.session_id, req.prompt_ids),
                                           self.config.probe_timeout_s)
            elif hasattr(probe, "probe"):
                # on the gate's own bounded pool, not the loop's default executor (see
                # GateBase._submit_probe); all threads busy answers unavailable at once
                fut = self._submit_probe(probe.probe, req.session_id, req.prompt_ids)
                if isinstance(fut, ProbeResult):
                    return fut
                try:
                    r = await wait_for(asyncio.wrap_future(fut), self.config.probe_timeout_s)
                finally:
                    fut.cancel()  # not started yet: never runs; running: keeps its thread
            else:
                return UNAVAILABLE
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

    async def _release(self, ticket: str, latency_s: float, turn_index: int | None) -> bool:
        params = {"ticket": ticket, "lat_ms": latency_s * 1000.0, "turn": turn_index}
        try:
            r = await self._eval("release", params)
        except RedisDown:
            self._defer(ticket, "release", params)  # sent once Redis answers (else the TTL reclaims it)
            return False
        return bool(r.get("released"))

    # -- sessions --------------------------------------------------------------------------
    async def finish_session(self, session_id: str) -> dict:
        """See ``Gate.finish_session``. With ``session_lifecycle`` on, the session's
        in-flight turns in this process are joined for up to ``close_timeout_s``, then
        cancelled, before ``/close_session`` goes to every engine."""
        check_session_id(session_id)
        out: dict[str, Any] = {"session_id": session_id}
        try:
            out.update(await self._eval("finish_session", {"session": session_id}))
        except RedisDown as e:
            out["error"] = str(e)
        self._forget_session(session_id)
        if self.config.session_lifecycle:
            me = asyncio.current_task()
            tasks = [t for t in self._inflight.get(session_id, ()) if t is not me and not t.done()]
            if tasks:
                done, pending = await asyncio.wait(tasks, timeout=self.config.close_timeout_s)
                for t in pending:
                    t.cancel()
                out["joined"] = len(done)
                out["aborted"] = len(pending)
            out["close"] = await self._close(session_id)
        return out

    async def _close(self, session_id: str) -> dict:
        from .lifecycle import aclose_session
        urls, bad = self._close_targets(await self._engine_urls(), session_id)
        res = await aclose_session(urls, session_id, timeout_s=self.config.close_timeout_s)
        attempts, failures = res.attempts + bad, res.failures + bad
        await self.record_close(attempts, failures)
        return {"attempts": attempts, "failures": failures}

    async def num_preempted(self, session_id: str) -> int:
        check_session_id(session_id)
        try:
            v = await self._plain(lambda: self.redis.hget(self.key("preempted"), session_id))
        except RedisDown:
            return 0
        return int(v or 0)

    # -- snapshots and housekeeping --------------------------------------------------------
    async def write_snapshot(self, engines: Sequence[EngineState], budget_scale: float | None = None) -> SnapshotResult:
        params = self._snapshot_params(engines, budget_scale)
        self._bind_loop()
        raw = await self._scripts["write_snapshot"](keys=self._keys, args=self._args(params))
        return self._snapshot_result(self._decode(raw))

    async def housekeep(self, limit: int = 100) -> dict:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit must be an int >= 1, got {limit!r}")
        self._bind_loop()
        return self._decode(await self._scripts["housekeep"](keys=self._keys, args=self._args({"limit": limit})))

    async def bump_epoch(self) -> int:
        self._bind_loop()
        raw = await self._scripts["bump_epoch"](keys=self._keys, args=self._args({}))
        return int(self._decode(raw)["epoch"])

    async def engine_urls(self) -> list[str]:
        return (await self._engine_urls()) or []

    async def _engine_urls(self) -> list[str] | None:
        """See ``Gate._engine_urls``; bounded by the call deadline."""
        if self.config.engine_urls:
            return list(self.config.engine_urls)
        try:
            raw = await self._plain(lambda: self.redis.hget(self.key("snapshot"), "engines"), breaker=False)
        except RedisDown:
            return None
        return engine_urls_from(self.config, raw)

    async def record_close(self, attempts: int, failures: int) -> None:
        def send() -> Any:
            p = self.redis.pipeline(transaction=False)
            for k in ("stats", "totals"):
                p.hincrby(self.key(k), "close", attempts)
                p.hincrby(self.key(k), "close_failure", failures)
            return p.execute()
        try:
            await self._plain(send)
        except RedisDown:
            with self._local_lock:
                self._local["close"] += attempts
                self._local["close_failure"] += failures

    async def status(self) -> dict:
        """The gate's state for operators: ledger, ceiling, usage, epoch, FIFO, leases,
        windows, snapshot age (by the Redis clock), engines and cumulative counters.
        Raises redis errors as they are (an operator wants to see them)."""
        self._bind_loop()
        raw = self._decode(await self._scripts["drain_stats"](keys=self._keys, args=self._args({"drain": 0})))
        p = self.redis.pipeline(transaction=False)
        p.hget(self.key("snapshot"), "engines")
        p.zrange(self.key("fifo"), 0, 9, withscores=True)
        p.hgetall(self.key("totals"))
        engines, head, totals = await p.execute()
        return self._status(raw, engines, head, totals)

    async def step_metrics(self, drain: bool = True) -> dict[str, float]:
        try:
            raw = await self._eval("drain_stats", {"drain": 1 if drain else 0})
        except RedisDown:
            raw = None
        return self._step_metrics(raw, drain)
