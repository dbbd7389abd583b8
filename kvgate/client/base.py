"""What the two drivers share: the public methods (each runs one flow of ``flows.py`` and is
written once: ``Gate._run`` answers the flow's result, ``AsyncGate._run`` a coroutine of it,
as redis-py's command mixins serve its sync and asyncio clients), the lease, and the small
helpers of the pub/sub listeners and waits."""
from __future__ import annotations

import json
import time
from typing import Any, Callable, Generator, Sequence

import redis

from .. import keys as _keys
from .._urls import SentinelURL, parse_sentinel_url
from ..config import GateConfig
from . import access
from .flows import AccessDenied, Command, Decision, GateFlows, Pipeline
from .probe import as_probe
from .scripts import ScriptCaller
from .snapshot import EngineState

# what counts as a Redis fault for both drivers (the async one adds its own deadline).
# RedisClusterException is a plain Exception in redis-py, not a RedisError: a cluster client
# raises it when no node answers while it rebuilds its node map
REDIS_ERRORS = (redis.RedisError, redis.exceptions.RedisClusterException, OSError)


def json_reply(raw: Any) -> Any:
    """A script's reply (JSON, as bytes or str) decoded."""
    return json.loads(raw.decode() if isinstance(raw, bytes) else raw)


def ticket_to_wake(msg: dict) -> str | None:
    """The ticket a pub/sub message of the gate's channel names for a re-check: ``g`` granted,
    ``p`` preempted (None for anything else)."""
    data = msg.get("data")
    if isinstance(data, bytes):
        data = data.decode(errors="replace")
    if not isinstance(data, str) or " " not in data:
        return None
    kind, arg = data.split(" ", 1)
    return arg if kind in ("g", "p") else None


def script_step(call: Generator, reply: Any = None, error: BaseException | None = None) -> tuple[bool, Any]:
    """Advance a script call (``ScriptCaller.call``) with its last command's reply, or the
    error that command raised: (False, the next command to send) or (True, the script's
    reply). An error the call does not handle is raised here."""
    try:
        return False, (call.throw(error) if error is not None else call.send(reply))
    except StopIteration as done:
        return True, done.value


def wait_step(deadline: float, abort_event: Any, poll_abort: bool) -> str | float:
    """One step of a driver's wait: "abort" or "timeout" when it is over, else how long to
    sleep on the ticket's event (short slices while an abort event must be polled)."""
    if abort_event is not None and abort_event.is_set():
        return "abort"
    left = deadline - time.monotonic()
    if left <= 0:
        return "timeout"
    return min(left, 0.05) if poll_abort else left


def sentinel_url(url: str, cluster: bool) -> SentinelURL:
    """A ``redis+sentinel://`` URL parsed (kvgate._urls), for either driver's ``from_url``."""
    if cluster:
        raise ValueError("a Sentinel URL names one primary: cluster=True does not apply to it")
    return parse_sentinel_url(url)


def _socket_kw(kw: dict) -> dict:
    """The socket bounds of a gate's client, which the sentinels' connections get too."""
    return {k: v for k, v in kw.items() if k.startswith("socket_")}


class GateBase:
    """The surface ``Gate`` and ``AsyncGate`` share. Each public method runs one flow through
    the driver's ``_run``: on an ``AsyncGate`` await what it returns."""

    def __init__(self, redis_client: Any, gate: str, config: GateConfig | None = None, probe: Any = None,
                 clock_ms: Callable[[], int] | None = None):
        self.name = _keys.validate_gate_name(gate)
        if config is None:
            # no config given: the knobs come from KVGATE_* over the defaults (SPEC section 6;
            # docs/decisions.md#config-from-env); GateConfig() is the way to ignore the env
            config = GateConfig.from_env()
        if not isinstance(config, GateConfig):
            raise ValueError(f"config must be a kvgate.GateConfig, got {type(config).__name__}")
        self.config = config
        self.probe = probe
        self.redis = redis_client
        self._flows = GateFlows(self.name, config, script_clock_ms=clock_ms)
        # encoded once: redis-py encodes every str argument of every call (15 keys a script call)
        self._keys = tuple(k.encode() for k in _keys.script_keys(self.name))
        # the listener subscribes to both: its own for its waiters' grants and preemptions, the
        # gate's for those a script of an earlier kvgate (no ch in its waiter records) publishes
        self.channel = _keys.channel(self.name)
        self.listen_channel = self._flows.listen_channel
        self._caller = ScriptCaller()
        self._owns_client = False

    @classmethod
    def from_url(cls, url: str, gate: str, config: GateConfig | None = None, probe: Any = None,
                 cluster: bool = False, **redis_kwargs: Any) -> Any:
        """A gate over a client this builds (and closes with the gate), with the connect and
        command timeouts of ``config.redis_timeout_s``. ``url`` is a redis-py URL
        (``redis://``, ``rediss://``, ``unix://``) or a Sentinel URL
        (``redis+sentinel://host:26379,host2:26379/<service>?db=0``, docs/deploy.md#sentinel):
        the client then follows the primary that Sentinel names. A malformed URL raises
        ValueError before any connection is made."""
        cfg = GateConfig.from_env() if config is None else config
        kw = dict(socket_connect_timeout=cfg.redis_timeout_s, socket_timeout=cfg.redis_timeout_s)
        kw.update(redis_kwargs)
        g = cls(cls._client_from_url(url, cluster, kw), gate=gate, config=cfg, probe=probe)
        g._owns_client = True
        return g

    @staticmethod
    def _client_from_url(url: str, cluster: bool, kw: dict) -> Any:
        raise NotImplementedError

    @property
    def probe(self) -> Any:
        """The residency probe (None: no probe). Settable; see ``probe.as_probe`` for what it may be."""
        return self._probe_given

    @probe.setter
    def probe(self, probe: Any) -> None:
        self._prober = as_probe(probe, blocking=self._blocking)
        self._probe_given = probe

    _blocking = True  # the driver calls probe() only

    def key(self, name: str) -> str:
        return _keys.key(self.name, name)

    @property
    def deferred_count(self) -> int:
        """Releases and cancels waiting for Redis to answer again (0 while it is healthy)."""
        return self._flows.deferred_count

    def _deadline_s(self) -> float:
        """The bound on one Redis call (connect + reply, and some slack): the async gate's
        deadline on each call, the sync close()'s wait for calls on the wire."""
        return self.config.redis_timeout_s * 2 + 0.5

    def _send_commands(self, op: Command | Pipeline, raise_on_error: bool = True) -> Any:
        """Send plain commands with the driver's client: the reply (a sync client) or an
        awaitable of it (an asyncio client). ``raise_on_error=False``: a pipeline's failed
        commands answer their exception (the access probe reads each)."""
        if isinstance(op, Command):
            return getattr(self.redis, op.name)(*op.args, **op.kwargs)
        p = self.redis.pipeline(transaction=False)
        for c in op.commands:
            getattr(p, c.name)(*c.args, **c.kwargs)
        return p.execute(raise_on_error=raise_on_error)

    def _access_probe(self, error: BaseException) -> Pipeline | None:
        """The probe that names what a refusal refused, or None when none can be sent (a
        failed AUTH: no connection would be accepted)."""
        if isinstance(error, redis.exceptions.AuthenticationError):
            return None
        return access.probe_commands(self.name)

    def _denied(self, error: BaseException, probe: Pipeline | None, replies: Any) -> AccessDenied:
        """What a driver throws into the flow for a refusal (``replies``: the probe's, or None)."""
        refused = access.refused_in(probe, replies) if probe is not None and replies is not None else None
        return AccessDenied(access.refusal_message(self.name, error, refused), error)

    # -- the public surface, once for both drivers ------------------------------------------
    def acquire(self, session_id: str, *, max_new_tokens: int, prompt_ids: Sequence[int] | None = None,
                prompt_tokens: int | None = None, protected: bool = False, scope: str = "train",
                retain_session: bool = True, abort_event: Any = None, turn_index: int | None = None,
                timeout_s: float | None = None, prefix_key: str | None = None,
                prefix_tokens: int | None = None) -> Any:
        """Decide one attempt of a turn; waits while the gate says so (bounded by ``max_wait_s``).

        ``prefix_key`` and ``prefix_tokens`` (both or neither) say that the prompt's first
        ``prefix_tokens`` tokens are a prefix other sessions send too (a GRPO task's prompt
        its samples share, a system prompt), named ``prefix_key``: the ledger charges it once
        while any holder of it is charged (docs/concepts.md#shared-prefixes).

        Returns a lease (admit / bypass / pass). Raises ``Preempted`` when a newer attempt of
        the session supersedes this one, ``AdmissionCancelled`` when ``abort_event`` is set,
        ``AdmissionTimeout`` after ``timeout_s``, ``ValueError`` for bad arguments. Cancelling
        an awaiting task (``AsyncGate``) removes its waiter atomically; a lease granted at
        that moment is given back.
        """
        if abort_event is not None and not hasattr(abort_event, "is_set"):
            raise ValueError("abort_event must be an Event (with is_set())")
        flow = self._flows.acquire(session_id, has_probe=self._prober is not None, max_new_tokens=max_new_tokens,
                                   prompt_ids=prompt_ids, prompt_tokens=prompt_tokens, protected=protected,
                                   scope=scope, retain_session=retain_session, turn_index=turn_index,
                                   timeout_s=timeout_s, prefix_key=prefix_key, prefix_tokens=prefix_tokens)
        return self._run(flow, abort=abort_event, then=self._lease)

    def finish_session(self, session_id: str) -> Any:
        """The session is done: end its ownership window and stop its waiting attempt; with
        ``session_lifecycle``, join its turns in flight in this process (other threads' or
        tasks') for up to ``close_timeout_s``, abort those still running, and send
        ``/close_session`` to every engine. Never raises on faults; returns what it did:
        ``session_id``, the script's counts, and with lifecycle ``joined`` and ``aborted``
        (ints) and ``close`` (attempts, failures); ``error`` when Redis did not answer."""
        return self._run(self._flows.finish_session(session_id))

    def num_preempted(self, session_id: str) -> Any:
        """How many waiting attempts of this session newer attempts preempted (until the
        session finishes); 0 when Redis does not answer."""
        return self._run(self._flows.num_preempted(session_id))

    def write_snapshot(self, engines: Sequence[EngineState], budget_scale: float | None = None) -> Any:
        """Store a capacity snapshot (atomically); a change of the healthy set bumps the
        epoch. ``budget_scale``: the scale the poller's controller measured (docs/budget.md).
        Raises ValueError for bad input and redis errors as they are (the poller reports them)."""
        return self._run(self._flows.write_snapshot(engines, budget_scale))

    def housekeep(self, limit: int = 100) -> Any:
        """Purge up to ``limit`` expired leases, windows and dead waiters (the poller calls it)."""
        return self._run(self._flows.housekeep(limit))

    def bump_epoch(self) -> Any:
        return self._run(self._flows.bump_epoch())

    def engine_urls(self) -> Any:
        """The engine base URLs a session's close goes to."""
        return self._run(self._flows.engine_urls())

    def record_close(self, attempts: int, failures: int) -> Any:
        return self._run(self._flows.record_close(attempts, failures))

    def status(self) -> Any:
        """The gate's state for operators: ledger, ceiling, usage, epoch, FIFO, leases,
        windows, snapshot age (by the Redis clock), engines and cumulative counters.
        Raises redis errors as they are (an operator wants to see them)."""
        return self._run(self._flows.status())

    def step_metrics(self, drain: bool = True) -> Any:
        """The step's flat ``agentic_kv/...`` dict (docs/operations.md); ``drain=False`` peeks."""
        return self._run(self._flows.step_metrics(drain))

    def _lease(self, d: Decision) -> "Lease":
        return self._lease_class(self, d)

    _lease_class: type = None  # type: ignore[assignment]


class Lease:
    """What an admitted (or bypassed, or passed-through) turn holds. ``release()`` is
    idempotent and never raises on faults; only an ``admit`` holds anything in Redis. On an
    ``AsyncGate``'s lease, await ``release()``: it is shielded from the caller's
    cancellation, so a cancelled turn still gives its lease back."""

    def __init__(self, gate: GateBase, d: Decision):
        self._gate = gate
        self.session_id = d.session_id
        self.ticket = d.ticket
        self.turn_index = d.turn_index
        self.prompt_tokens = d.prompt_tokens
        self.outcome = d.outcome
        self.reason = d.reason
        self.waited_s = d.waited_s
        self.tokens = d.tokens
        self.epoch = d.epoch
        self.held = d.held
        self.released = not d.held
        self._ended = d.outcome == "pass"   # a pass-through turn reports no gap
        self._t0 = gate._flows.clock()

    @property
    def admitted(self) -> bool:
        return self.outcome == "admit"

    def release(self) -> Any:
        """Give the lease back (an ownership window turns idle). True when this call released it."""
        return self._gate._run(self._release(), shield=True)

    def _release(self) -> Generator[Any, Any, bool]:
        if not self._ended:  # the turn is over, held or not: the session's tool gap starts now
            self._ended = True
            self._gate._flows.turn_ended(self.session_id, self.prompt_tokens)
        if self.released:
            return False
        self.released = True
        flows = self._gate._flows
        return (yield from flows.release(self.ticket, flows.clock() - self._t0, self.turn_index))

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(session={self.session_id!r}, outcome={self.outcome!r}, "
                f"reason={self.reason!r}, waited_s={self.waited_s:.3f}, tokens={self.tokens}, "
                f"ticket={self.ticket!r})")

