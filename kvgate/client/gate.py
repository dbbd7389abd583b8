"""The synchronous gate, for threaded code: a driver of the flows in ``flows.py`` that
performs their operations with blocking I/O. ``kvgate.AsyncGate`` drives the same flows."""
from __future__ import annotations

import contextlib
import threading
import time
import warnings
from typing import Any, Callable, Generator, Iterator

import redis
import redis.sentinel
from redis.backoff import NoBackoff
from redis.retry import Retry

from .._urls import is_sentinel_url
from . import access
from .base import REDIS_ERRORS, GateBase, _socket_kw, sentinel_url, Lease, json_reply, script_step, ticket_to_wake, wait_step
from .flows import Eval, Probe, RedisDown, Run
from .lifecycle import CloseResult, close_session
from .probe import ProbeResult, ProbeThreads, coerce

__all__ = ["Gate", "Lease"]


class Gate(GateBase):
    """A gate over one Redis, shared with any number of other processes.

    ``Gate(redis_client, gate="name", config=GateConfig(...), probe=...)`` takes any
    redis-py client (``Redis``, ``RedisCluster``, fakeredis); ``Gate.from_url`` builds one
    with the connect and command timeouts of ``config.redis_timeout_s``. The sync gate's
    bound on a stalled Redis is the client's socket timeout: it warns when a redis-py
    client has none or retries timeouts.
    ``clock_ms`` injects the scripts' clock (tests, simulation); production uses Redis time.
    """

    _lease_class = Lease

    def __init__(self, redis_client: Any, gate: str, config: Any = None, probe: Any = None, clock_ms: Any = None):
        super().__init__(redis_client, gate, config, probe, clock_ms)
        _warn_unbounded(redis_client)
        self._listener = _Listener(self)
        self._probe_threads = ProbeThreads()
        # session -> {thread ident: turns in flight}: finish_session joins the other threads' turns
        self._inflight: dict[str, dict[int, int]] = {}
        self._inflight_cv = threading.Condition()
        self._calls = 0                      # script calls on the wire (close() waits for them)
        self._calls_cv = threading.Condition()

    @staticmethod
    def _client_from_url(url: str, cluster: bool, kw: dict) -> Any:
        if is_sentinel_url(url):
            su = sentinel_url(url, cluster)
            # no retries with backoff (redis-py's default waits seconds between them): a call
            # to a dead primary fails within redis_timeout_s, the turn degrades, and the next
            # call after the breaker asks the sentinels for the new primary
            kw.setdefault("retry", Retry(NoBackoff(), 0))
            # the sentinels answer within the gate's bound too (a dead sentinel is skipped)
            sentinel = redis.sentinel.Sentinel(su.sentinels, sentinel_kwargs={**_socket_kw(kw), **su.sentinel_kwargs})
            return sentinel.master_for(su.service, **{**kw, **su.master_kwargs})
        if cluster:
            # RedisCluster retries timeouts 10 times with backoff by default: a stalled primary
            # would hold each call ~14 s instead of redis_timeout_s (the breaker then degrades
            # turns, and the next call after it reads the new topology)
            kw.setdefault("retry", Retry(NoBackoff(), 0))
            return redis.RedisCluster.from_url(url, **kw)
        return redis.Redis.from_url(url, **kw)

    def close(self) -> None:
        """Wait (for one call's bound) for script calls other threads have on the wire, send
        what was deferred, stop the listener and the probe threads, and close the client if
        ``from_url`` built it (a client passed in is the caller's). Closing the client under
        another thread's release made it raise, and left its lease charged until lease_ttl_s."""
        with self._calls_cv:
            self._calls_cv.wait_for(lambda: self._calls == 0, timeout=self._deadline_s())
        with contextlib.suppress(Exception):
            self._run(self._flows.flush_at_close())
        self._listener.close()
        self._probe_threads.shutdown()
        if self._owns_client:
            with contextlib.suppress(Exception):
                self.redis.close()
            if isinstance(getattr(self.redis, "connection_pool", None), redis.sentinel.SentinelConnectionPool):
                with contextlib.suppress(Exception):
                    self.redis.connection_pool.sentinel_manager.close()  # the sentinels' connections

    def __enter__(self) -> "Gate":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- the driver --------------------------------------------------------------------------
    def _run(self, flow: Generator, abort: Any = None, shield: bool = False,
             then: Callable[[Any], Any] | None = None) -> Any:
        """Run a flow to its end, performing each operation it yields (``shield`` is the async
        gate's: a thread is not cancelled from outside)."""
        run = Run(flow, self._listener, abort)
        try:
            while (op := run.next()) is not Run.DONE:
                fn, args = run.handler(self, op)
                try:
                    run.send(fn(*args))
                except BaseException as e:  # noqa: BLE001 - a fault or an interrupt goes into the flow
                    run.fail(e)
        finally:
            run.close()
        return run.value if then is None else then(run.value)

    def _eval(self, op: Eval) -> dict:
        with self._calls_cv:
            self._calls += 1
        try:
            raw = self._call_script(op)
        except Exception as e:  # noqa: BLE001 - only the call is in here: any failure of it is a fault
            if access.is_refusal(e):
                raise self._refused(e) from e  # a configuration error, not a fault
            # REDIS_ERRORS, and what a client closed under the call raises ("I/O operation on
            # closed file" is a ValueError): the agent loop must never see it (SPEC 8)
            raise RedisDown(str(e) or type(e).__name__, e) from e
        finally:
            with self._calls_cv:
                self._calls -= 1
                self._calls_cv.notify_all()
        return json_reply(raw)

    def _call_script(self, op: Eval) -> Any:
        """The reply of one script call: the commands ``ScriptCaller.call`` asks for, one by one
        (one FCALL, unless the library must be loaded first or the server runs EVAL only)."""
        call = self._caller.call(op.script, self._keys, op.argv)
        done, out = script_step(call)
        while not done:
            try:
                reply, error = self._send_commands(out), None
            except Exception as e:  # noqa: BLE001 - thrown into the call, which raises what it does not handle
                reply, error = None, e
            done, out = script_step(call, reply, error)
        return out

    def _command(self, op: Any) -> Any:
        try:
            return self._send_commands(op)
        except REDIS_ERRORS as e:
            if access.is_refusal(e):
                raise self._refused(e) from e
            raise RedisDown(str(e) or type(e).__name__, e) from e

    def _refused(self, error: BaseException) -> RedisDown:
        """A refusal, with what the access probe finds refused (best effort: the probe's own
        faults leave Redis's words alone)."""
        probe, replies = self._access_probe(error), None
        if probe is not None:
            with contextlib.suppress(*REDIS_ERRORS):
                replies = self._send_commands(probe, raise_on_error=False)
        return self._denied(error, probe, replies)

    def _wait(self, ev: threading.Event, timeout_s: float, abort_event: Any) -> str:
        if self._listener.ensure_started():
            return "signal"  # just subscribed: re-check once so no grant was missed
        deadline = time.monotonic() + timeout_s
        while True:
            step = wait_step(deadline, abort_event, poll_abort=abort_event is not None)
            if isinstance(step, str):
                return step
            if ev.wait(step):
                ev.clear()
                return "signal"

    def _probe(self, op: Probe) -> ProbeResult:
        fut = self._probe_threads.submit(self._prober.probe, op.session_id, op.prompt_ids)
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

    def _close_session(self, op: Any) -> CloseResult:
        return close_session(op.urls, op.session_id, timeout_s=op.timeout_s)

    # -- turns in flight -------------------------------------------------------------------
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

    def _others_inflight(self, session_id: str) -> int:
        """Turns of this session in flight in other threads (a turn's own thread calling
        finish_session inside its ``with`` block does not wait for itself)."""
        me = threading.get_ident()
        return sum(n for t, n in self._inflight.get(session_id, {}).items() if t != me)

    def _join(self, session_id: str, timeout_s: float) -> tuple[int, int]:
        """Wait up to ``timeout_s`` for the session's turns in other threads: (how many ended,
        how many still run). A thread cannot be stopped from outside: those go on until their
        engine call returns (the close goes out regardless)."""
        deadline = time.monotonic() + timeout_s
        with self._inflight_cv:
            before = self._others_inflight(session_id)
            while self._others_inflight(session_id) and time.monotonic() < deadline:
                self._inflight_cv.wait(max(0.0, deadline - time.monotonic()))
            left = self._others_inflight(session_id)
        return max(0, before - left), left


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
        ticket = ticket_to_wake(msg)
        if ticket is not None:
            with self._lock:
                ev = self._events.get(ticket)
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
                pubsub.subscribe(**{self._gate.channel: self._on_message,
                                    self._gate.listen_channel: self._on_message})
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
