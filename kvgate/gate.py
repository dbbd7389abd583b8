"""The synchronous gate, for threaded code. ``kvgate.AsyncGate`` has the same surface."""
from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from typing import Any, Iterator, Sequence

import redis

from ._base import GateBase, LeaseBase, engine_urls_from
from ._flow import Decision, Eval, Probe, RedisDown, TurnRequest, Wait, acquire_flow
from .config import GateConfig
from .probe import UNAVAILABLE, ProbeResult, coerce
from .snapshot import EngineState, SnapshotResult

REDIS_ERRORS = (redis.RedisError, OSError)


class Lease(LeaseBase):
    """What an admitted (or bypassed, or passed-through) turn holds. ``release()`` is
    idempotent; only an ``admit`` holds anything in Redis."""

    def release(self) -> bool:
        """Give the lease back (turns an ownership window idle). Never raises on faults."""
        if not self._begin_release():
            return False
        return self._gate._release(self.ticket, time.monotonic() - self._t0, self.turn_index)


class _Listener:
    """One pub/sub subscription per process (per Gate): wakes the local waiter a message
    names. Waiters poll anyway, so a lost message costs at most one poll."""

    def __init__(self, gate: "Gate"):
        self._gate = gate
        self._events: dict[str, threading.Event] = {}
        self._lock = threading.Lock()
        self._thread = None
        self._pubsub = None

    def register(self, ticket: str) -> threading.Event:
        ev = threading.Event()
        with self._lock:
            self._events[ticket] = ev
        return ev

    def unregister(self, ticket: str) -> None:
        with self._lock:
            self._events.pop(ticket, None)

    def _on_message(self, msg: dict) -> None:
        data = msg.get("data")
        if isinstance(data, bytes):
            data = data.decode(errors="replace")
        if not isinstance(data, str) or " " not in data:
            return
        kind, arg = data.split(" ", 1)
        if kind in ("g", "p", "a"):  # granted, preempted, may age now: re-check
            with self._lock:
                ev = self._events.get(arg)
            if ev is not None:
                ev.set()

    def ensure_started(self) -> bool:
        """Start the subscription thread if needed; True when it was just started."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return False
            try:
                self._pubsub = self._gate.redis.pubsub(ignore_subscribe_messages=True)
                self._pubsub.subscribe(**{self._gate.channel: self._on_message})
                self._thread = self._pubsub.run_in_thread(
                    sleep_time=0.5, daemon=True, exception_handler=self._on_error)
            except REDIS_ERRORS:
                self._thread = None
            return True

    def _on_error(self, exc: BaseException, pubsub: Any, thread: Any) -> None:
        # the thread ends; the next waiter restarts it. Waiters keep polling meanwhile.
        try:
            thread.stop()
        except Exception:  # noqa: BLE001
            pass

    def close(self) -> None:
        with self._lock:
            t, self._thread = self._thread, None
            ps, self._pubsub = self._pubsub, None
        if t is not None:
            with contextlib.suppress(Exception):
                t.stop()
                t.join(timeout=2)
        if ps is not None:
            with contextlib.suppress(Exception):
                ps.close()


class Gate(GateBase):
    """A gate over one Redis, shared with any number of other processes.

    ``Gate(redis_client, gate="name", config=GateConfig(...), probe=...)`` takes any
    redis-py client (``Redis``, ``RedisCluster``, fakeredis); ``Gate.from_url`` builds one
    with the connect and command timeouts of ``config.redis_timeout_s``.
    ``clock_ms`` injects the scripts' clock (tests, simulation); production uses Redis time.
    """

    def __init__(self, redis_client: Any, gate: str, config: GateConfig | None = None, probe: Any = None,
                 clock_ms: Any = None):
        super().__init__(gate, config, probe, clock_ms)
        self.redis = redis_client
        self._scripts = {n: redis_client.register_script(src) for n, src in self._sources.items()}
        self._listener = _Listener(self)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._inflight: dict[str, int] = {}
        self._inflight_cv = threading.Condition()

    @classmethod
    def from_url(cls, url: str, gate: str, config: GateConfig | None = None, probe: Any = None,
                 cluster: bool = False, **redis_kwargs: Any) -> "Gate":
        cfg = config or GateConfig()
        kw = dict(socket_connect_timeout=cfg.redis_timeout_s, socket_timeout=cfg.redis_timeout_s)
        kw.update(redis_kwargs)
        if cluster:
            client = redis.RedisCluster.from_url(url, **kw)
        else:
            client = redis.Redis.from_url(url, **kw)
        return cls(client, gate=gate, config=cfg, probe=probe)

    def close(self) -> None:
        self._listener.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        with contextlib.suppress(Exception):
            self.redis.close()

    def __enter__(self) -> "Gate":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- Redis ---------------------------------------------------------------------------
    def _eval(self, name: str, params: dict) -> dict:
        if self._breaker_open():
            raise RedisDown("breaker open after a recent Redis fault")
        try:
            raw = self._scripts[name](keys=self._keys, args=self._args(params))
        except REDIS_ERRORS as e:
            self._trip()
            raise RedisDown(str(e)) from e
        return self._decode(raw)

    # -- turns -----------------------------------------------------------------------------
    def acquire(self, session_id: str, *, prompt_ids: Sequence[int] | None = None,
                prompt_tokens: int | None = None, max_new_tokens: int | None = None, protected: bool = False,
                scope: str = "train", retain_session: bool = True, abort_event: Any = None,
                turn_index: int | None = None, timeout_s: float | None = None) -> Lease:
        """Decide one attempt of a turn; blocks while it waits (bounded by ``max_wait_s``).

        Returns a Lease (admit / bypass / pass). Raises ``Preempted`` when a newer attempt
        of the session supersedes this one, ``AdmissionCancelled`` when ``abort_event`` is
        set, ``AdmissionTimeout`` after ``timeout_s``, ``ValueError`` for bad arguments.
        """
        if abort_event is not None and not hasattr(abort_event, "is_set"):
            raise ValueError("abort_event must be an Event (with is_set())")
        req = self._request(session_id, dict(prompt_ids=prompt_ids, prompt_tokens=prompt_tokens,
                                             max_new_tokens=max_new_tokens, protected=protected, scope=scope,
                                             retain_session=retain_session, turn_index=turn_index,
                                             timeout_s=timeout_s))
        d = self._drive(req, abort_event)
        self._count_unseen(d)
        return Lease(self, req, d)

    @contextlib.contextmanager
    def turn(self, session_id: str, **kw: Any) -> Iterator[Lease]:
        """``with gate.turn(sid, prompt_ids=ids, max_new_tokens=n) as lease:`` wraps one
        engine call; the lease is released when the block exits, however it exits."""
        lease = self.acquire(session_id, **kw)
        if lease.outcome != "pass":
            # counted here, not in acquire(): only turn() knows when the engine call ends
            with self._inflight_cv:
                self._inflight[lease.session_id] = self._inflight.get(lease.session_id, 0) + 1
        try:
            yield lease
        finally:
            lease.release()
            self._turn_done(lease)

    def _turn_done(self, lease: Lease) -> None:
        if lease.outcome == "pass":
            return
        with self._inflight_cv:
            n = self._inflight.get(lease.session_id, 0) - 1
            if n <= 0:
                self._inflight.pop(lease.session_id, None)
            else:
                self._inflight[lease.session_id] = n
            self._inflight_cv.notify_all()

    def _drive(self, req: TurnRequest, abort_event: Any) -> Decision:
        gen = acquire_flow(self.config, req, self._knobs, self.probe is not None, time.monotonic)
        ev = self._listener.register(req.ticket)
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
                        send = self._eval(op.script, op.params)
                    except RedisDown as e:
                        throw = e
                elif isinstance(op, Probe):
                    send = self._probe(req)
                elif isinstance(op, Wait):
                    send = self._wait(ev, op.timeout_s, abort_event)
                else:  # pragma: no cover
                    raise AssertionError(op)
        except BaseException as e:
            from .errors import KvgateError
            if not isinstance(e, (KvgateError, ValueError)):
                # interrupted mid-wait (KeyboardInterrupt, a failure in a probe...): never leak
                self._cancel_quietly(req.ticket)
            raise
        finally:
            self._listener.unregister(req.ticket)
            gen.close()

    def _cancel_quietly(self, ticket: str) -> None:
        with contextlib.suppress(RedisDown):
            self._eval("cancel", {"ticket": ticket})

    def _wait(self, ev: threading.Event, timeout_s: float, abort_event: Any) -> str:
        if self._listener.ensure_started():
            return "signal"  # just subscribed: re-check once so no grant was missed
        deadline = time.monotonic() + timeout_s
        while True:
            if abort_event is not None and abort_event.is_set():
                return "abort"
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout"
            step = left if abort_event is None else min(left, 0.05)
            if ev.wait(step):
                ev.clear()
                return "signal"

    def _probe(self, req: TurnRequest) -> ProbeResult:
        probe = self.probe
        if probe is None or req.prompt_ids is None:
            return UNAVAILABLE
        fn = getattr(probe, "probe", None)
        if fn is None:
            return UNAVAILABLE
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvgate-probe")
        fut = self._pool.submit(fn, req.session_id, req.prompt_ids)
        try:
            return coerce(fut.result(timeout=self.config.probe_timeout_s))
        except Exception as e:  # noqa: BLE001 - a failed probe is an unavailable probe
            return ProbeResult(None, detail=f"probe failed: {type(e).__name__}: {e}")

    def _release(self, ticket: str, latency_s: float, turn_index: int | None) -> bool:
        try:
            r = self._eval("release", {"ticket": ticket, "lat_ms": latency_s * 1000.0, "turn": turn_index})
        except RedisDown:
            return False  # the TTL reclaims it
        return bool(r.get("released"))

    # -- sessions --------------------------------------------------------------------------
    def finish_session(self, session_id: str) -> dict:
        """The session is done: end its ownership window, stop its waiting attempt, and
        with ``session_lifecycle`` join its in-flight turns (bounded) and send
        ``/close_session`` to every engine. Never raises on faults; returns what it did."""
        if not isinstance(session_id, str) or not session_id:
            raise ValueError(f"session_id must be a non-empty string, got {session_id!r}")
        out: dict[str, Any] = {"session_id": session_id}
        try:
            out.update(self._eval("finish_session", {"session": session_id}))
        except RedisDown as e:
            out["error"] = str(e)
        self._forget_session(session_id)
        if self.config.session_lifecycle:
            deadline = time.monotonic() + self.config.close_timeout_s
            with self._inflight_cv:
                while self._inflight.get(session_id) and time.monotonic() < deadline:
                    self._inflight_cv.wait(max(0.0, deadline - time.monotonic()))
                out["joined"] = not self._inflight.get(session_id)
            out["close"] = self._close(session_id)
        return out

    def _close(self, session_id: str) -> dict:
        from .lifecycle import close_session
        urls = self.engine_urls()
        res = close_session(urls, session_id, timeout_s=self.config.close_timeout_s)
        self.record_close(res.attempts, res.failures)
        return {"attempts": res.attempts, "failures": res.failures}

    def num_preempted(self, session_id: str) -> int:
        """How many waiting attempts of this session newer attempts preempted (until the
        session finishes)."""
        try:
            v = self.redis.hget(self.key("preempted"), session_id)
        except REDIS_ERRORS:
            return 0
        return int(v or 0)

    # -- snapshots and housekeeping --------------------------------------------------------
    def write_snapshot(self, engines: Sequence[EngineState]) -> SnapshotResult:
        """Store a capacity snapshot (atomically); a change of the healthy set bumps the
        epoch. Raises ValueError for bad input and redis errors as they are (the poller
        reports them)."""
        params = self._snapshot_params(engines)
        raw = self._scripts["write_snapshot"](keys=self._keys, args=self._args(params))
        return self._snapshot_result(self._decode(raw))

    def housekeep(self, limit: int = 100) -> dict:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit must be an int >= 1, got {limit!r}")
        return self._decode(self._scripts["housekeep"](keys=self._keys, args=self._args({"limit": limit})))

    def bump_epoch(self) -> int:
        return int(self._decode(self._scripts["bump_epoch"](keys=self._keys, args=self._args({})))["epoch"])

    def engine_urls(self) -> list[str]:
        if self.config.engine_urls:
            return list(self.config.engine_urls)
        try:
            return engine_urls_from(self.config, self.redis.hget(self.key("snapshot"), "engines"))
        except REDIS_ERRORS:
            return []

    def record_close(self, attempts: int, failures: int) -> None:
        try:
            p = self.redis.pipeline(transaction=False)
            for k in ("stats", "totals"):
                p.hincrby(self.key(k), "close", attempts)
                p.hincrby(self.key(k), "close_failure", failures)
            p.execute()
        except REDIS_ERRORS:
            with self._local_lock:
                self._local["close"] += attempts
                self._local["close_failure"] += failures

    # -- inspection -------------------------------------------------------------------------
    def status(self) -> dict:
        """The gate's state for operators: ledger, ceiling, usage, epoch, FIFO, leases,
        windows, snapshot age (by the Redis clock), engines and cumulative counters.
        Raises redis errors as they are (an operator wants to see them)."""
        raw = self._decode(self._scripts["drain_stats"](keys=self._keys, args=self._args({"drain": 0})))
        p = self.redis.pipeline(transaction=False)
        p.hget(self.key("snapshot"), "engines")
        p.zrange(self.key("fifo"), 0, 9, withscores=True)
        p.hgetall(self.key("totals"))
        engines, head, totals = p.execute()
        return self._status(raw, engines, head, totals)

    def step_metrics(self, drain: bool = True) -> dict[str, float]:
        try:
            raw = self._eval("drain_stats", {"drain": 1 if drain else 0})
        except RedisDown:
            raw = None
        return self._step_metrics(raw)
