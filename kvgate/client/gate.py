"""The synchronous gate, for threaded code. ``kvgate.AsyncGate`` has the same surface."""
from __future__ import annotations

import contextlib
import threading
import time
import warnings
from typing import Any, Iterator, Sequence

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from .base import PROBE_THREADS  # noqa: F401 - also kvgate.client.gate's name for it
from .base import REDIS_ERRORS, GateBase, LeaseBase, engine_urls_from
from .flows import BreakerOpen, Decision, Eval, Probe, RedisDown, TurnRequest, Wait, acquire_flow, check_session_id
from ..config import GateConfig
from .probe import UNAVAILABLE, ProbeResult, coerce
from .snapshot import EngineState, SnapshotResult


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
        self._lock = threading.Lock()        # guards _events
        self._start_lock = threading.Lock()  # one thread (re)subscribes; others do not wait on it
        self._thread = None
        self._pubsub = None
        self._retry_at = 0.0                 # no resubscribe before this (monotonic) after a failure
        self._closed = False                 # set by close(): never subscribe again

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

    def _retry_delay(self) -> float:
        return min(1.0, self._gate.config.wait_poll_s)

    def ensure_started(self) -> bool:
        """Start the subscription thread if needed; True when it was just started (the caller
        re-checks once, so no grant published before the subscription is missed). False while
        it runs, while another thread is starting it, and for a while after a failed start:
        waiters then poll, they never spin on Redis."""
        if self._closed or (self._thread is not None and self._thread.is_alive()):
            return False
        if not self._start_lock.acquire(blocking=False):
            return False
        try:
            if self._closed or (self._thread is not None and self._thread.is_alive()):
                return False
            if time.monotonic() < self._retry_at:
                return False
            pubsub = None
            try:
                pubsub = self._gate.redis.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(**{self._gate.channel: self._on_message})
                thread = pubsub.run_in_thread(sleep_time=0.5, daemon=True, exception_handler=self._on_error)
            except REDIS_ERRORS:
                self._retry_at = time.monotonic() + self._retry_delay()
                if pubsub is not None:
                    with contextlib.suppress(Exception):
                        pubsub.close()
                return False
            self._pubsub, self._thread = pubsub, thread
            return True
        finally:
            self._start_lock.release()

    def _on_error(self, exc: BaseException, pubsub: Any, thread: Any) -> None:
        # the thread ends; a waiter restarts it after a short delay. Waiters poll meanwhile.
        self._retry_at = time.monotonic() + self._retry_delay()
        try:
            thread.stop()
        except Exception:  # noqa: BLE001
            pass

    def close(self) -> None:
        with self._start_lock:
            self._closed = True  # a waiter still polling must not subscribe again
            t, self._thread = self._thread, None
            ps, self._pubsub = self._pubsub, None
        if t is not None:
            with contextlib.suppress(Exception):
                t.stop()
                t.join(timeout=2)
        if ps is not None:
            with contextlib.suppress(Exception):
                ps.close()


def _warn_unbounded(client: Any) -> None:
    """The sync gate's calls are bounded by the client's own socket timeout (the async gate
    puts a deadline on each call). Warn when a redis-py client has none, or retries timeouts:
    a stalled Redis would then block turns for that long instead of degrading them."""
    if not isinstance(client, redis.Redis) or not type(client).__module__.startswith("redis"):
        return  # fakeredis, a cluster client or a wrapper: not ours to judge
    kw = getattr(getattr(client, "connection_pool", None), "connection_kwargs", None)
    if not isinstance(kw, dict):
        return
    retry = kw.get("retry")
    retries = getattr(retry, "_retries", 0) or 0
    if kw.get("socket_timeout") is None or retries > 0:
        warnings.warn(
            f"kvgate.Gate: this redis client has socket_timeout={kw.get('socket_timeout')!r} and "
            f"retries {retries} times, so a stalled Redis blocks turns instead of degrading them "
            f"within redis_timeout_s; build it with kvgate.Gate.from_url(...), or pass "
            f"socket_timeout=... and retry=Retry(NoBackoff(), 0)", RuntimeWarning, stacklevel=3)


class Gate(GateBase):
    """A gate over one Redis, shared with any number of other processes.

    ``Gate(redis_client, gate="name", config=GateConfig(...), probe=...)`` takes any
    redis-py client (``Redis``, ``RedisCluster``, fakeredis); ``Gate.from_url`` builds one
    with the connect and command timeouts of ``config.redis_timeout_s``. The sync gate's
    bound on a stalled Redis is the client's socket timeout: it warns when a redis-py
    client has none or retries timeouts.
    ``clock_ms`` injects the scripts' clock (tests, simulation); production uses Redis time.
    """

    def __init__(self, redis_client: Any, gate: str, config: GateConfig | None = None, probe: Any = None,
                 clock_ms: Any = None):
        super().__init__(gate, config, probe, clock_ms)
        self.redis = redis_client
        _warn_unbounded(redis_client)
        self._scripts = {n: redis_client.register_script(src) for n, src in self._sources.items()}
        self._listener = _Listener(self)
        # session -> {thread ident: turns in flight}: finish_session joins the other threads' turns
        self._inflight: dict[str, dict[int, int]] = {}
        self._inflight_cv = threading.Condition()
        self._calls = 0                      # script calls on the wire (close() waits for them)
        self._calls_cv = threading.Condition()

    @classmethod
    def from_url(cls, url: str, gate: str, config: GateConfig | None = None, probe: Any = None,
                 cluster: bool = False, **redis_kwargs: Any) -> "Gate":
        cfg = GateConfig.from_env() if config is None else config
        kw = dict(socket_connect_timeout=cfg.redis_timeout_s, socket_timeout=cfg.redis_timeout_s)
        kw.update(redis_kwargs)
        if cluster:
            # RedisCluster retries timeouts 10 times with backoff by default: a stalled primary
            # would hold each call ~14 s instead of redis_timeout_s (the breaker then degrades
            # turns, and the next call after it reads the new topology)
            kw.setdefault("retry", Retry(NoBackoff(), 0))
            client = redis.RedisCluster.from_url(url, **kw)
        else:
            client = redis.Redis.from_url(url, **kw)
        g = cls(client, gate=gate, config=cfg, probe=probe)
        g._owns_client = True
        return g

    def close(self) -> None:
        """Wait (for one call's bound) for script calls other threads have on the wire, send
        what was deferred, stop the listener and the probe threads, and close the client if
        ``from_url`` built it (a client passed in is the caller's). Closing the client under
        another thread's release made it raise, and left its lease charged until lease_ttl_s."""
        with self._calls_cv:
            self._calls_cv.wait_for(lambda: self._calls == 0, timeout=self._deadline_s())
        self._flush_at_close()
        self._listener.close()
        self._shutdown_probe_pool()
        if self._owns_client:
            with contextlib.suppress(Exception):
                self.redis.close()

    def __enter__(self) -> "Gate":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _flush_at_close(self) -> None:
        """See ``GateBase._close_flushes``."""
        with contextlib.suppress(Exception):
            for _ in range(self._close_flushes()):
                self._flush_deferred()

    # -- Redis ---------------------------------------------------------------------------
    def _eval(self, name: str, params: dict) -> dict:
        if self._breaker_open():
            raise BreakerOpen("breaker open after a recent Redis fault")
        if self._deferred:
            self._flush_deferred()
        return self._call(name, params)

    def _call(self, name: str, params: dict) -> dict:
        args = self._args(params)
        with self._calls_cv:
            self._calls += 1
        try:
            raw = self._scripts[name](keys=self._keys, args=args)
        except Exception as e:  # noqa: BLE001 - only the call is in here: any failure of it is a fault
            # REDIS_ERRORS, and what a client closed under the call raises ("I/O operation on
            # closed file" is a ValueError): the agent loop must never see it (SPEC 8)
            self._trip()
            raise RedisDown(str(e) or type(e).__name__) from e
        finally:
            with self._calls_cv:
                self._calls -= 1
                self._calls_cv.notify_all()
        return self._decode(raw)

    def _plain(self, fn: Any, breaker: bool = True) -> Any:
        """A plain Redis command outside the scripts (finish_session's engine URLs and close
        counters, num_preempted): skipped while the breaker is open (unless ``breaker`` is
        False), a fault trips it. Raises RedisDown."""
        if breaker and self._breaker_open():
            raise BreakerOpen("breaker open after a recent Redis fault")
        try:
            return fn()
        except REDIS_ERRORS as e:
            self._trip()
            raise RedisDown(str(e) or type(e).__name__) from e

    def _flush_deferred(self) -> None:
        """Send releases and cancels that Redis missed, before the call that found it back;
        on a fault the rest stay deferred and the call is not sent (BreakerOpen)."""
        items = self._take_deferred()
        for i, (_, script, params) in enumerate(items):
            try:
                self._call(script, params)
            except RedisDown as e:
                self._undo_take(items[i:])
                raise BreakerOpen(f"Redis faulted while sending deferred releases: {e}") from e
            except BaseException:
                self._undo_take(items[i:])  # never lose what was taken (KeyboardInterrupt, bugs)
                raise

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
            me = threading.get_ident()
            with self._inflight_cv:
                per = self._inflight.setdefault(lease.session_id, {})
                per[me] = per.get(me, 0) + 1
        try:
            yield lease
        finally:
            try:
                lease.release()
            finally:
                self._turn_done(lease)  # also when release raised: finish_session must not wait for it

    def _turn_done(self, lease: Lease) -> None:
        if lease.outcome == "pass":
            return
        me = threading.get_ident()
        with self._inflight_cv:
            per = self._inflight.get(lease.session_id, {})
            n = per.get(me, 0) - 1
            if n <= 0:
                per.pop(me, None)
            else:
                per[me] = n
            if not per:
                self._inflight.pop(lease.session_id, None)
            self._inflight_cv.notify_all()

    def _others_inflight(self, session_id: str) -> bool:
        """Turns of this session in flight in other threads (a turn's own thread calling
        finish_session inside its ``with`` block does not wait for itself)."""
        me = threading.get_ident()
        return any(n > 0 for t, n in self._inflight.get(session_id, {}).items() if t != me)

    def _drive(self, req: TurnRequest, abort_event: Any) -> Decision:
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
                        send = self._eval(op.script, op.params)
                    except RedisDown as e:
                        throw = e
                        sent = self._eval_failed(req.ticket, op.script, op.params, e, sent)
                    else:
                        sent = True
                elif isinstance(op, Probe):
                    send = self._probe(req)
                elif isinstance(op, Wait):
                    send = self._wait(ev, op.timeout_s, abort_event)
                else:  # pragma: no cover
                    raise AssertionError(op)
        except BaseException as e:
            from ..errors import KvgateError
            if not isinstance(e, (KvgateError, ValueError)):
                # interrupted mid-wait (KeyboardInterrupt, a failure in a probe...): never leak
                self._cancel_quietly(req.ticket)
            raise
        finally:
            self._listener.unregister(req.ticket)
            gen.close()

    def _cancel_quietly(self, ticket: str) -> None:
        try:
            self._eval("cancel", {"ticket": ticket})
        except RedisDown:
            self._defer(ticket, "cancel", {"ticket": ticket})

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
        fut = self._submit_probe(fn, req.session_id, req.prompt_ids)
        if isinstance(fut, ProbeResult):  # every probe thread busy, or the gate closed
            return fut
        try:
            return coerce(fut.result(timeout=self.config.probe_timeout_s))
        except Exception as e:  # noqa: BLE001 - a failed probe is an unavailable probe
            fut.cancel()
            return ProbeResult(None, detail=f"probe failed: {type(e).__name__}: {e}")
        except BaseException as e:
            # raised by the probe in its thread (SystemExit, CancelledError, GeneratorExit...):
            # a probe fault, never an interrupt of this caller; a KeyboardInterrupt that hit
            # this thread while it waited is not the future's, and goes on
            if fut.done() and not fut.cancelled() and fut.exception() is e:
                return ProbeResult(None, detail=f"probe failed: {type(e).__name__}: {e}")
            fut.cancel()
            raise

    def _release(self, ticket: str, latency_s: float, turn_index: int | None) -> bool:
        params = {"ticket": ticket, "lat_ms": latency_s * 1000.0, "turn": turn_index}
        try:
            r = self._eval("release", params)
        except RedisDown:
            self._defer(ticket, "release", params)  # sent once Redis answers (else the TTL reclaims it)
            return False
        return bool(r.get("released"))

    # -- sessions --------------------------------------------------------------------------
    def finish_session(self, session_id: str) -> dict:
        """The session is done: end its ownership window, stop its waiting attempt, and
        with ``session_lifecycle`` join its in-flight turns (bounded) and send
        ``/close_session`` to every engine. Never raises on faults; returns what it did."""
        check_session_id(session_id)
        out: dict[str, Any] = {"session_id": session_id}
        try:
            out.update(self._eval("finish_session", {"session": session_id}))
        except RedisDown as e:
            out["error"] = str(e)
        self._forget_session(session_id)
        if self.config.session_lifecycle:
            deadline = time.monotonic() + self.config.close_timeout_s
            with self._inflight_cv:
                while self._others_inflight(session_id) and time.monotonic() < deadline:
                    self._inflight_cv.wait(max(0.0, deadline - time.monotonic()))
                out["joined"] = not self._others_inflight(session_id)
            out["close"] = self._close(session_id)
        return out

    def _close(self, session_id: str) -> dict:
        from .lifecycle import close_session
        urls, bad = self._close_targets(self._engine_urls(), session_id)
        res = close_session(urls, session_id, timeout_s=self.config.close_timeout_s)
        attempts, failures = res.attempts + bad, res.failures + bad
        self.record_close(attempts, failures)
        return {"attempts": attempts, "failures": failures}

    def num_preempted(self, session_id: str) -> int:
        """How many waiting attempts of this session newer attempts preempted (until the
        session finishes)."""
        check_session_id(session_id)
        try:
            v = self._plain(lambda: self.redis.hget(self.key("preempted"), session_id))
        except RedisDown:
            return 0
        return int(v or 0)

    # -- snapshots and housekeeping --------------------------------------------------------
    def write_snapshot(self, engines: Sequence[EngineState], budget_scale: float | None = None) -> SnapshotResult:
        """Store a capacity snapshot (atomically); a change of the healthy set bumps the
        epoch. Raises ValueError for bad input and redis errors as they are (the poller
        reports them)."""
        params = self._snapshot_params(engines, budget_scale)
        raw = self._scripts["write_snapshot"](keys=self._keys, args=self._args(params))
        return self._snapshot_result(self._decode(raw))

    def housekeep(self, limit: int = 100) -> dict:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit must be an int >= 1, got {limit!r}")
        return self._decode(self._scripts["housekeep"](keys=self._keys, args=self._args({"limit": limit})))

    def bump_epoch(self) -> int:
        return int(self._decode(self._scripts["bump_epoch"](keys=self._keys, args=self._args({})))["epoch"])

    def engine_urls(self) -> list[str]:
        return self._engine_urls() or []

    def _engine_urls(self) -> list[str] | None:
        """The close targets, or None when Redis could not be read. Asked even while the
        breaker is open (bounded by the client's timeout): a session's close must not go to
        no engine because another call failed a moment ago."""
        if self.config.engine_urls:
            return list(self.config.engine_urls)
        try:
            raw = self._plain(lambda: self.redis.hget(self.key("snapshot"), "engines"), breaker=False)
        except RedisDown:
            return None
        return engine_urls_from(self.config, raw)

    def record_close(self, attempts: int, failures: int) -> None:
        def send() -> Any:
            p = self.redis.pipeline(transaction=False)
            for k in ("stats", "totals"):
                p.hincrby(self.key(k), "close", attempts)
                p.hincrby(self.key(k), "close_failure", failures)
            return p.execute()
        try:
            self._plain(send)
        except RedisDown:
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
        return self._step_metrics(raw, drain)
