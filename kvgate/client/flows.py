"""Every gate operation, written once, with no I/O: the sync ``Gate`` and the ``AsyncGate``
drive the same generators (httpx's ``Auth.auth_flow``, psycopg's generators).

A flow yields operations (``Listen``, ``Eval``, ``Command``, ``Pipeline``, ``Probe``, ``Wait``,
``Join``, ``Close``: each class says what it answers) and receives their results, and returns
what the public method returns. ``Gate._run`` and ``AsyncGate._run`` are the two drivers: one
loop each that performs the operations with blocking or asyncio I/O.

When Redis cannot answer an ``Eval``, ``Command`` or ``Pipeline``, the driver throws
``RedisDown`` into the flow instead of a result; when Redis refuses it (NOPERM, a failed
AUTH), ``AccessDenied``, and the flow raises ``kvgate.RedisAccessDenied`` (a configuration
error does not fail open: kvgate/client/access.py). When anything else stops the driver
mid-operation (``KeyboardInterrupt``, asyncio cancellation), it throws ``Interrupted``: the
flow gives back what its ticket may hold, and the driver then raises the original exception.

The breaker, the give-backs deferred after a fault, this process's counters and what it
remembers of each session live in one ``GateFlows`` per gate; time comes from its injected
``clock`` (and the scripts' from ``script_clock_ms``). ``Run`` is a driver's bookkeeping of
one flow: it steps the generator and says which driver method performs each operation.

This module is over 400 lines on purpose: a turn's whole path, from the arguments of
``acquire`` to the script's ARGV, reads top to bottom here, once, and hands the driver an
operation it only has to perform (no module between them, none visited twice).
"""
from __future__ import annotations

import json
import logging
import math
import threading
import time
import uuid
from collections import Counter, OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Generator, Sequence

import redis.exceptions as redis_errors

from .. import keys as _keys
from .._urls import normalize_base_url
from ..config import GateConfig
from ..errors import AdmissionCancelled, AdmissionTimeout, Preempted, RedisAccessDenied, ScriptError
from . import metrics
from .probe import UNAVAILABLE, ProbeResult
from .snapshot import EngineState, SnapshotResult

log = logging.getLogger("kvgate")

Flow = Generator[Any, Any, Any]

#: after a Redis fault, calls skip Redis for this long (turns bypass as degraded), so a dead
#: Redis costs one timeout per breaker period, not one per turn
BREAKER_S = 1.0
#: releases and cancels kept to send once Redis answers again (the oldest dropped past this:
#: their leases are then reclaimed by ``lease_ttl_s``)
MAX_DEFERRED = 4096
#: most deferred give-backs one call sends before its own script
DEFERRED_BATCH = 32
#: releases, cancels and session finishes Redis confirmed within this many seconds before the
#: latest one are sent again when another Redis process answers (its run_id changed: a failover): the
#: replica promoted lacked the writes it had not received yet: a lost release would keep its
#: lease charged until ``lease_ttl_s``, a lost finish its window for ``idle_grace_s``
#: (docs/decisions.md#failover-replays-give-backs). Far above any healthy replication lag.
REPLAY_S = 10.0
#: sessions whose last turn end this process remembers (for the tool gap it reports)
MAX_TRACKED_SESSIONS = 65536
#: a close that went to no engine, and a Redis fault, are each logged at most once per this
#: many seconds (always counted; the line says how many it stands for)
WARN_EVERY_S = 60.0
#: the most tokens a turn's prompt or decode budget may claim: far above any model's
#: context, and low enough that the ledger's sums stay exact in the scripts (Lua's ``%d``
#: and cjson's 14 significant digits)
MAX_TURN_TOKENS = 2**31 - 1
#: the longest session id (it is part of Redis keys: ``:window:<session>``)
MAX_SESSION_ID = 512
#: the most nested shared prefixes a turn may name (a system prompt, a task's prompt, ...):
#: each is a record the scripts read and write per turn
MAX_PREFIX_LEVELS = 4


# -- operations ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Listen:
    """Wake this run's ``Wait`` on pub/sub messages naming ``ticket`` -> None."""
    ticket: str


@dataclass(frozen=True)
class Eval:
    """Call a Lua script with ``argv`` (the script clock, and the knobs with ``params`` as
    JSON: ``GateFlows.eval_op`` builds it) -> its decoded reply."""
    script: str
    params: dict
    argv: tuple = field(default=(), compare=False, repr=False)


@dataclass(frozen=True)
class Command:
    """One plain Redis command, a redis-py method name and its arguments -> its reply."""
    name: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Pipeline:
    """Several ``Command``s sent together (no transaction) -> their replies."""
    commands: tuple


@dataclass(frozen=True)
class Probe:
    """Ask the gate's residency probe -> a ``ProbeResult`` (UNAVAILABLE on errors and timeouts)."""
    session_id: str
    prompt_ids: Sequence[int]


@dataclass(frozen=True)
class Wait:
    """Sleep until a message names the ticket, the abort event is set, or ``timeout_s`` ->
    "signal", "abort" or "timeout"."""
    timeout_s: float


@dataclass(frozen=True)
class Join:
    """Wait up to ``timeout_s`` for the session's other turns in flight in this process, then
    abort those still running -> (joined, aborted)."""
    session_id: str
    timeout_s: float


@dataclass(frozen=True)
class Close:
    """``POST /close_session`` to every URL -> a ``CloseResult``."""
    urls: tuple
    session_id: str
    timeout_s: float


class RedisDown(Exception):
    """Thrown into a flow when Redis could not answer (fault, timeout, breaker open);
    ``error`` is what the client raised (None when nothing was sent)."""

    def __init__(self, message: str, error: BaseException | None = None):
        super().__init__(message)
        self.error = error


class AccessDenied(RedisDown):
    """Redis refused the call (NOPERM, a failed AUTH: kvgate/client/access.py): not a fault,
    so the flow raises ``RedisAccessDenied`` instead of failing open; the message names what
    is missing."""


class BreakerOpen(RedisDown):
    """A RedisDown before anything was sent (the breaker is open after a recent fault, or
    the deferred give-backs ahead of the call failed), so the call certainly did not run."""


class Interrupted(Exception):
    """Thrown into a flow when its driver was stopped mid-operation by something else than a
    Redis fault (``error``): the flow gives back what it may hold and lets it propagate."""

    def __init__(self, error: BaseException):
        super().__init__(repr(error))
        self.error = error


def describe_fault(error: BaseException) -> str:
    """What a Redis fault means for the gate, in the words of the one log line it gets."""
    if isinstance(error, RedisDown) and error.error is not None:
        error = error.error
    if isinstance(error, redis_errors.OutOfMemoryError):
        return ("Redis refuses writes: it is out of memory (used_memory over maxmemory, and the policy "
                "noeviction); free memory or raise maxmemory, and gating resumes by itself")
    said = str(error)
    return f"Redis did not answer ({type(error).__name__}{': ' + said if said else ''})"


class WarnEvery:
    """One log line per ``every_s`` for a recurring event: ``due(now)`` counts the event and
    answers how many events the line to write now stands for, or 0 when it is not due (the
    caller holds its lock)."""

    def __init__(self, every_s: float = WARN_EVERY_S):
        self.every_s = every_s
        self._at: float | None = None
        self._unlogged = 0

    def due(self, now: float) -> int:
        self._unlogged += 1
        if self._at is not None and now - self._at < self.every_s:
            return 0
        self._at, n, self._unlogged = now, self._unlogged, 0
        return n


# -- one run of a flow by a driver ----------------------------------------------------------
class Run:
    """One run of a flow by a driver: what to send into the flow next, the pub/sub event
    of its ticket (``Listen`` is done here, with the driver's listener), the caller's abort
    event, and the exception that interrupted it."""

    DONE = object()

    def __init__(self, flow: Flow, listener: Any, abort: Any = None):
        self.flow = flow
        self.listener = listener
        self.abort = abort
        self.ticket: str | None = None
        self.event: Any = None
        self.value: Any = None
        self.interrupted: BaseException | None = None
        self._send: Any = None
        self._throw: BaseException | None = None

    def next(self) -> Any:
        """The flow's next operation for the driver, or ``DONE`` (its result in ``value``).
        After an interruption, the interrupting exception is raised once the flow cleaned up."""
        while True:
            try:
                op = self.flow.throw(self._throw) if self._throw is not None else self.flow.send(self._send)
            except StopIteration as stop:
                if self.interrupted is not None:
                    raise self.interrupted
                self.value = stop.value
                return self.DONE
            except Interrupted as i:
                raise i.error from None
            self._send, self._throw = None, None
            if not isinstance(op, Listen):
                return op
            self.ticket, self.event = op.ticket, self.listener.register(op.ticket)

    def close(self) -> None:
        """The run is over: stop listening for its ticket, and close the flow."""
        if self.ticket is not None:
            self.listener.unregister(self.ticket)
        self.flow.close()

    def send(self, result: Any) -> None:
        self._send = result

    def handler(self, driver: Any, op: Any) -> tuple[Callable, tuple]:
        """The driver method that performs ``op``, and its arguments."""
        if isinstance(op, Eval):
            return driver._eval, (op,)
        if isinstance(op, Wait):
            return driver._wait, (self.event, op.timeout_s, self.abort)
        if isinstance(op, Probe):
            return driver._probe, (op,)
        if isinstance(op, (Command, Pipeline)):
            return driver._command, (op,)
        if isinstance(op, Join):
            return driver._join, (op.session_id, op.timeout_s)
        if isinstance(op, Close):
            return driver._close_session, (op,)
        raise AssertionError(f"no driver for {op!r}")

    def fail(self, e: BaseException) -> None:
        """An operation raised ``e``: a Redis fault goes into the flow as it is, anything else
        (a second time: raised) as ``Interrupted``."""
        if isinstance(e, RedisDown):
            self._throw = e
        elif self.interrupted is None:
            self.interrupted = e
            self._throw = Interrupted(e)
        else:
            raise e


# -- what a turn asks and what it gets -------------------------------------------------------
@dataclass(frozen=True)
class TurnRequest:
    session_id: str
    ticket: str
    need: int
    prompt_tokens: int
    prompt_ids: Sequence[int] | None
    protected: bool = False
    retain: bool = True
    scope: str = "train"
    turn_index: int | None = None
    timeout_s: float | None = None
    gap_s: float | None = None   # the session's time away since its last turn ended (this process saw it)
    prev_prompt_tokens: int | None = None  # the prompt of the session's last turn here (what the engines may still hold)
    # the shared prefixes the prompt starts with, outermost first: (key, leading tokens) each
    prefixes: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class Decision:
    outcome: str            # "admit" | "bypass" | "pass"
    reason: str             # see docs/concepts.md (empty for "pass")
    waited_s: float = 0.0
    tokens: int = 0
    epoch: int = -1
    held: bool = False      # True when Redis holds a lease that must be released
    session_id: str = ""
    ticket: str = ""
    turn_index: int | None = None
    prompt_tokens: int = 0


def new_ticket() -> str:
    return uuid.uuid4().hex


def finish_key(session_id: str) -> str:
    """A finished session's entry among the give-backs kept by ticket (tickets are hex: the
    two never meet)."""
    return "finish " + session_id


def check_session_id(session_id: Any) -> str:
    """The one rule for a session id, used by the gates, the close fan-out and the probes: a
    non-empty str of at most ``MAX_SESSION_ID`` characters that encodes as UTF-8 (a lone
    surrogate would make every script call for it fail)."""
    return _check_name("session_id", session_id)


def _check_name(what: str, value: Any) -> str:
    """A name that goes into Redis (a session id, a prefix key): a non-empty str of at most
    ``MAX_SESSION_ID`` characters that encodes as UTF-8; ValueError naming ``what`` else."""
    if not isinstance(value, str) or not value or len(value) > MAX_SESSION_ID:
        raise ValueError(f"{what} must be a non-empty string of at most {MAX_SESSION_ID} characters, got {value!r}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what} must be valid Unicode (no lone surrogates), got {value!r}") from None
    return value


#: what a turn may say it is (``scope=``); the gate's config ``scope`` says which it gates
TURN_SCOPES = ("train", "eval")


def build_request(cfg: GateConfig, session_id: Any, *, max_new_tokens: Any, prompt_ids: Sequence[int] | None = None,
                  prompt_tokens: int | None = None, protected: bool = False, scope: str = "train",
                  retain_session: bool = True, turn_index: int | None = None, timeout_s: float | None = None,
                  ticket: str | None = None, prefix_key: Any = None, prefix_tokens: Any = None) -> TurnRequest:
    """Validate a turn's arguments (before anything touches Redis) and size its reservation."""
    check_session_id(session_id)
    if (prompt_ids is None) == (prompt_tokens is None):
        raise ValueError("give exactly one of prompt_ids (token ids) or prompt_tokens (a count)")
    if prompt_ids is not None:
        if isinstance(prompt_ids, (str, bytes)) or not hasattr(prompt_ids, "__len__"):
            raise ValueError(f"prompt_ids must be a sequence of token ids, got {type(prompt_ids).__name__}")
        n_prompt = len(prompt_ids)
    else:
        if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int) or prompt_tokens < 0:
            raise ValueError(f"prompt_tokens must be an int >= 0, got {prompt_tokens!r}")
        n_prompt = prompt_tokens
    if n_prompt > MAX_TURN_TOKENS:
        raise ValueError(f"a prompt of {n_prompt} tokens is more than a turn may claim ({MAX_TURN_TOKENS})")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if max_new_tokens > MAX_TURN_TOKENS:
        raise ValueError(f"max_new_tokens={max_new_tokens} is more than a turn may claim ({MAX_TURN_TOKENS})")
    if scope not in TURN_SCOPES:
        raise ValueError(f"a turn's scope is what the turn is, 'train' or 'eval', got {scope!r} (the gate's "
                         f"config scope, 'train' or 'all', says which of them it gates)")
    if turn_index is not None and (isinstance(turn_index, bool) or not isinstance(turn_index, int) or turn_index < 0):
        raise ValueError(f"turn_index must be an int >= 0, got {turn_index!r}")
    if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                  or not math.isfinite(timeout_s) or timeout_s < 0):
        raise ValueError(f"timeout_s must be a finite number >= 0, got {timeout_s!r}")
    prefixes = check_prefixes(prefix_key, prefix_tokens, n_prompt)
    decode = max_new_tokens
    cap = cfg.effective("expected_decode_cap")  # never an unchecked cap (admission off)
    if cap is not None:
        decode = min(decode, cap)
    return TurnRequest(session_id=session_id, ticket=ticket or new_ticket(), need=n_prompt + decode,
                       prompt_tokens=n_prompt, prompt_ids=prompt_ids, protected=bool(protected),
                       retain=bool(retain_session), scope=scope, turn_index=turn_index, timeout_s=timeout_s,
                       prefixes=prefixes)


def check_prefixes(prefix_key: Any, prefix_tokens: Any, n_prompt: int) -> tuple[tuple[str, int], ...]:
    """The sharing arguments of a turn, as (key, leading tokens) levels, outermost first (empty:
    nothing shared). Both or neither; one prefix as a str and an int, or nested ones (a system
    prompt, then a task's prompt that starts with it) as equally long sequences of at most
    ``MAX_PREFIX_LEVELS``. A key is a name as a session id is (it names a record in Redis) and
    appears once; the lengths are ints that grow level by level, up to the prompt's tokens. A
    single length of 0 shares nothing."""
    if (prefix_key is None) != (prefix_tokens is None):
        raise ValueError("give both prefix_key (which prefix the prompt shares) and prefix_tokens (its length), "
                         "or neither")
    if prefix_key is None:
        return ()
    nested = isinstance(prefix_key, (list, tuple))
    if not nested and not isinstance(prefix_key, str):
        raise TypeError(f"prefix_key must be a str or a list of them, got {type(prefix_key).__name__}")
    if nested != isinstance(prefix_tokens, (list, tuple)):
        raise TypeError("prefix_key and prefix_tokens must both be one value or both be lists, got "
                        f"{type(prefix_key).__name__} and {type(prefix_tokens).__name__}")
    keys, toks = (list(prefix_key), list(prefix_tokens)) if nested else ([prefix_key], [prefix_tokens])
    if nested and not 1 <= len(keys) == len(toks) <= MAX_PREFIX_LEVELS:
        raise ValueError(f"prefix_key and prefix_tokens must be equally long, 1 to {MAX_PREFIX_LEVELS} levels, "
                         f"got {len(keys)} and {len(toks)}")
    for k in keys:
        if not isinstance(k, str):
            raise TypeError(f"prefix_key must be a str or a list of them, got {type(k).__name__}")
        _check_name("prefix_key", k)
    if len(set(keys)) != len(keys):
        raise ValueError(f"prefix_key names a prefix twice: {keys!r}")
    below = 0 if nested else -1
    for t in toks:
        if isinstance(t, bool) or not isinstance(t, int):
            raise TypeError(f"prefix_tokens must be an int or a list of them, got {type(t).__name__}")
        if not below < t <= n_prompt:
            raise ValueError(f"prefix_tokens must grow level by level within the prompt's {n_prompt} tokens "
                             f"(from 0), got {prefix_tokens!r}")
        below = t
    return tuple((k, t) for k, t in zip(keys, toks) if t > 0)


def _json(obj: dict) -> str:
    return json.dumps(obj, separators=(",", ":"))


def knob_params(cfg: GateConfig, channel: str) -> dict:
    """The knobs sent with every script call (lua/includes/common.lua lists them, each
    script's header names the ones it reads; a missing one is a script error: the defaults
    live in ``GateConfig`` only). A feature's knobs are the values the gate uses
    (``GateConfig.effective``): never an unchecked one of a feature that is off, which the
    scripts may still read (the ceiling's headroom) or JSON cannot carry."""
    wait_ms = int(cfg.wait_poll_s * 1000)
    eff = cfg.effective
    return {
        "admission": 1 if cfg.admission else 0, "residency": 1 if cfg.residency else 0,
        "high_watermark": eff("high_watermark"), "pressure_threshold": eff("pressure_threshold"),
        "hit_threshold": eff("hit_threshold"), "headroom": eff("headroom"),
        "staleness_ms": int(cfg.staleness_s * 1000), "lease_ttl_ms": int(cfg.lease_ttl_s * 1000),
        "idle_grace_ms": int(cfg.idle_grace_s * 1000),
        # a waiter re-checks at least every wait_poll_s: two missed polls mean it is gone
        "alive_ms": 2 * wait_ms + 1000, "claim_ms": 2 * wait_ms + 1000,
        "max_wait_ms": int(cfg.max_wait_s * 1000), "max_wait_hard_ms": int(cfg.max_wait_hard_s * 1000),
        "budget_scale": cfg.budget_scale if cfg.budget_scale is not None else -1,
        "reap_batch": cfg.reap_batch, "channel": channel,
    }


def snapshot_params(engines: Sequence[EngineState], budget_scale: float | None = None) -> dict:
    """write_snapshot.lua's parameters, checked: a list of distinct engines, and the measured
    budget scale (a finite number > 0) or None."""
    if isinstance(engines, EngineState) or not all(isinstance(e, EngineState) for e in engines):
        raise ValueError("write_snapshot takes a list of kvgate.EngineState")
    ids = [e.engine_id for e in engines]
    if len(set(ids)) != len(ids):
        raise ValueError(f"duplicate engine ids in snapshot: {sorted(ids)}")
    params: dict = {"engines": [e.to_script() for e in engines]}
    if budget_scale is not None:
        if (isinstance(budget_scale, bool) or not isinstance(budget_scale, (int, float))
                or not math.isfinite(budget_scale) or budget_scale <= 0):
            raise ValueError(f"budget_scale must be a finite number > 0, got {budget_scale!r}")
        params["measured_scale"] = float(budget_scale)
    return params


def passes_through(cfg: GateConfig, req: TurnRequest) -> bool:
    """Rule 1: no gating feature on, or the turn is outside the gate's scope."""
    return not cfg.gating or (cfg.scope == "train" and req.scope != "train")


# -- the flows -------------------------------------------------------------------------------
class GateFlows:
    """One gate's operations as flows, and the process-local state they share (thread-safe:
    a sync gate runs flows from many threads). ``clock`` is monotonic seconds."""

    def __init__(self, name: str, config: GateConfig, clock: Callable[[], float] = time.monotonic,
                 script_clock_ms: Callable[[], int] | None = None):
        self.name = name
        self.config = config
        self.clock = clock
        self.script_clock_ms = script_clock_ms  # None: the scripts read Redis time
        self.knobs = knob_params(config, _keys.channel(name))
        # this gate object's own channel: its waiters' grants and preemptions come there, so a
        # grant wakes the one process that waits for it (every acquire names it: ``ch``)
        self.listen_channel = _keys.listener_channel(name, uuid.uuid4().hex[:16])
        self._lock = threading.Lock()
        self._breaker_until = float("-inf")
        # releases and cancels Redis has not confirmed: ticket -> (script, params); sent
        # before the next script call once the breaker is closed (docs/concepts.md#failing-open)
        self._deferred: OrderedDict[str, tuple[str, dict]] = OrderedDict()
        # releases, cancels and finishes Redis confirmed lately: ticket (``finish_key`` for a
        # finish) -> (clock(), script, params);
        # deferred again when another Redis process answers, as a failover may have lost them
        self._confirmed: OrderedDict[str, tuple[float, str, dict]] = OrderedDict()
        self._server: str | None = None  # the run_id of the Redis process that answered last
        self.local: Counter = Counter()  # outcomes decided without Redis (pass, degraded on faults)
        self.turns: Counter = Counter()  # session -> next turn index
        self.last_end: OrderedDict[str, float] = OrderedDict()  # session -> clock() at its last turn end
        self.last_prompt: OrderedDict[str, int] = OrderedDict()  # session -> prompt tokens of its last turn
        self._close_warn = WarnEvery()  # closes that reached no engine
        self._fault_warn = WarnEvery()  # Redis faults (turns bypass as degraded meanwhile)

    def key(self, name: str) -> str:
        return _keys.key(self.name, name)

    @property
    def knobs(self) -> dict:
        """The knobs every script call sends (``knob_params``); set a new dict to change them."""
        return self._knobs

    @knobs.setter
    def knobs(self, knobs: dict) -> None:
        self._knobs = dict(knobs)
        # their JSON, written once: every call sends the same text (ARGV[3])
        self._knobs_json = _json(self._knobs)

    def eval_op(self, script: str, params: dict) -> Eval:
        """The call of ``script``: ARGV[1] the injected script clock (empty: Redis time),
        ARGV[2] ``params`` as JSON, ARGV[3] the knobs' JSON, the same text on every call (the
        function library decodes it once: lua/includes/common.lua)."""
        now = "" if self.script_clock_ms is None else str(int(self.script_clock_ms()))
        return Eval(script, params, (now, _json(params), self._knobs_json))

    # -- a turn ---------------------------------------------------------------------------
    def acquire(self, session_id: Any, *, has_probe: bool, **kw: Any) -> Flow:
        """Decide one attempt of a turn: returns a ``Decision``, or raises ``Preempted``,
        ``AdmissionCancelled``, ``AdmissionTimeout`` (``ValueError`` for bad arguments)."""
        req = self._remember_turn(build_request(self.config, session_id, **kw))
        if passes_through(self.config, req):
            d = Decision("pass", "")
        else:
            yield Listen(req.ticket)
            try:
                d = yield from self._decide(req, has_probe)
            except Interrupted:
                # stopped mid-call or mid-wait: remove the waiter, or give back a lease granted
                # at that moment (cancel.lua does either, atomically)
                yield from self._give_back(req.ticket, "cancel", {"ticket": req.ticket})
                raise
        d = replace(d, session_id=req.session_id, ticket=req.ticket, turn_index=req.turn_index,
                    prompt_tokens=req.prompt_tokens)
        if d.outcome == "pass" or (d.outcome == "bypass" and d.epoch < 0):
            self._count(d)  # outcomes Redis did not count: pass-through, bypasses decided without it
        return d

    def _decide(self, req: TurnRequest, has_probe: bool) -> Flow:
        cfg = self.config
        clock = self.clock
        sent = False  # a script call for this ticket may have run

        def call(script: str, params: dict) -> Flow:
            nonlocal sent
            try:
                r = yield from self._script(script, dict(params))
            except RedisDown as e:
                # a failure after the call left may have run it: give back whatever this ticket
                # may hold once Redis answers (a failed cancel is retried as it was)
                if sent or not isinstance(e, BreakerOpen):
                    sent = True
                    self._defer(req.ticket, "cancel", params if script == "cancel" else {"ticket": req.ticket})
                raise
            sent = True
            return r

        def cancel(degraded: bool = False) -> Flow:
            try:
                yield from call("cancel", {"ticket": req.ticket, "degraded": 1 if degraded else 0})
            except RedisDown:
                pass  # deferred by call(); meanwhile its waiter record dies by liveness

        start = clock()
        # the scripts age the FIFO head by the Redis clock; this local bound is the safety net
        # that keeps "no wait past max_wait_hard_s + one poll" even if that clock misbehaves
        hard_deadline = start + cfg.max_wait_hard_s + cfg.wait_poll_s
        no_probe = -2
        params = dict(ticket=req.ticket, session=req.session_id, need=req.need, prompt=req.prompt_tokens,
                      protected=1 if req.protected else 0, retain=1 if req.retain else 0,
                      probe=-1 if (cfg.residency and has_probe) else no_probe, ch=self.listen_channel)
        if req.gap_s is not None:
            params["gap"] = round(req.gap_s * 1000.0, 1)
        if req.prev_prompt_tokens is not None:
            params["prev_prompt"] = req.prev_prompt_tokens
        if req.prefixes:
            params["prefixes"] = [list(level) for level in req.prefixes]
        probe_default = params["probe"]

        def degraded() -> Decision:
            return Decision("bypass", "protected" if req.protected else "degraded", clock() - start)

        try:
            r = yield from call("acquire", params)
        except RedisDown:
            return degraded()
        params.pop("gap", None)  # one sample per attempt: re-checks do not report it again
        while True:
            o = r.get("o")
            if o == "admit":
                return Decision("admit", r["r"], float(r.get("w", 0)) / 1000.0, int(r.get("t", 0)),
                                int(r.get("ep", -1)), held=True)
            if o == "bypass":
                return Decision("bypass", r["r"], float(r.get("w", 0)) / 1000.0, 0, int(r.get("ep", -1)))
            if o == "preempted":
                raise Preempted(req.session_id, req.ticket, r.get("r", "preempted"))
            if o == "probe":
                if "b" in r and "t0" not in params:
                    params["t0"] = r["b"]  # when this attempt began (by the scripts' clock)
                result: ProbeResult = UNAVAILABLE
                if req.prompt_ids is not None:
                    result = yield Probe(req.session_id, req.prompt_ids)
                params["probe"] = result.hit_ratio if result.hit_ratio is not None else no_probe
            elif o == "wait":
                now = clock()
                if now >= hard_deadline:
                    if params.get("age") != 1:
                        # this process's clock says the wait is over while the script's (Redis
                        # time, from the enqueue) does not yet: ask the script to age it now, so
                        # an aged turn is decided there like any other (a lease, and a window)
                        params["age"] = 1
                        try:
                            r = yield from call("acquire", params)
                        except RedisDown:
                            return degraded()
                        continue
                    # the script would not age it even when asked: a clock fault, so fail open
                    yield from cancel(degraded=True)
                    return Decision("bypass", "degraded", now - start, epoch=0)
                if req.timeout_s is not None and now - start >= req.timeout_s:
                    yield from cancel()
                    raise AdmissionTimeout(f"turn of session {req.session_id!r} waited {now - start:.3f}s "
                                           f"(timeout_s={req.timeout_s})")
                # re-check every poll: the head may age (no progress for max_wait_s) at any time
                timeout = min(cfg.wait_poll_s, max(0.0, hard_deadline - now) + 0.01)
                if req.timeout_s is not None:
                    timeout = min(timeout, max(0.0, req.timeout_s - (now - start)) + 0.001)
                ev = yield Wait(timeout)
                if ev == "abort":
                    yield from cancel()
                    raise AdmissionCancelled(f"turn of session {req.session_id!r} was aborted while waiting")
                params["probe"] = probe_default
            else:
                raise ScriptError(f"acquire.lua returned an unknown outcome: {r!r}")
            try:
                r = yield from call("acquire", params)
            except RedisDown:
                return degraded()
            params["probe"] = probe_default

    def release(self, ticket: str, latency_s: float, turn_index: int | None) -> Flow:
        """Give a lease back (an ownership window turns idle); never raises on faults: a
        release Redis did not confirm is sent again later. True when this call released it."""
        r = yield from self._give_back(ticket, "release",
                                       {"ticket": ticket, "latency_ms": latency_s * 1000.0, "turn_index": turn_index})
        return bool(r and r.get("released"))

    def turn_ended(self, session_id: str, prompt_tokens: int) -> None:
        """A turn of this session ended here (held or not): its tool gap starts now, and its
        prompt is what the session's next turn extends."""
        with self._lock:
            for d, v in ((self.last_end, self.clock()), (self.last_prompt, prompt_tokens)):
                d[session_id] = v
                d.move_to_end(session_id)
                while len(d) > MAX_TRACKED_SESSIONS:
                    d.popitem(last=False)

    def _remember_turn(self, req: TurnRequest) -> TurnRequest:
        """Number the session's turns, take the time it spent away (its tool call) since its
        last turn ended here (taken once, so a retry does not report it again), and the prompt
        of that turn (the budget controller's re-prefill estimate, docs/budget.md)."""
        changes: dict[str, Any] = {}
        with self._lock:
            if req.turn_index is None:
                changes["turn_index"] = self.turns[req.session_id]
                self.turns[req.session_id] += 1
            ended = self.last_end.pop(req.session_id, None)
            prev = self.last_prompt.get(req.session_id)
            # the session id is in use again: a finish of its earlier life, sent again after a
            # failover, would end this life's window or stop its waiting attempt
            self._confirmed.pop(finish_key(req.session_id), None)
            self._deferred.pop(finish_key(req.session_id), None)
        if prev is not None:
            changes["prev_prompt_tokens"] = prev
        if ended is not None:
            changes["gap_s"] = max(0.0, self.clock() - ended)
        return replace(req, **changes) if changes else req

    # -- a session's end ------------------------------------------------------------------
    def finish_session(self, session_id: Any) -> Flow:
        """End the session's window, stop its waiting attempt and, with ``session_lifecycle``,
        join its other turns in flight (up to ``close_timeout_s``; the rest are aborted) and
        send ``/close_session`` to every engine. Never raises on faults."""
        check_session_id(session_id)
        out: dict[str, Any] = {"session_id": session_id}
        try:
            out.update((yield from self._script("finish_session", {"session": session_id})))
        except RedisDown as e:
            out["error"] = str(e)
        else:
            # a failover may lose it as it may lose a release: sent again then, as ``again``
            # (finish_session.lua counts a finish sent again only when it still changed something)
            out.pop("srv", None)
            self._confirm(finish_key(session_id), "finish_session", {"session": session_id, "again": 1})
        with self._lock:
            self.turns.pop(session_id, None)
            self.last_end.pop(session_id, None)
            self.last_prompt.pop(session_id, None)
        if self.config.session_lifecycle:
            out["joined"], out["aborted"] = yield Join(session_id, self.config.close_timeout_s)
            urls, bad = self._close_targets((yield from self._engine_urls()), session_id)
            res = yield Close(tuple(urls), session_id, self.config.close_timeout_s)
            attempts, failures = res.attempts + bad, res.failures + bad
            yield from self.record_close(attempts, failures)
            out["close"] = {"attempts": attempts, "failures": failures}
        return out

    def engine_urls(self) -> Flow:
        """The engine base URLs a session's close goes to ([] when they cannot be read)."""
        return (yield from self._engine_urls()) or []

    def _engine_urls(self) -> Flow:
        """The close targets, or None when Redis could not be read. Asked even while the
        breaker is open: a session's close must not go to no engine because another call
        failed a moment ago."""
        if self.config.engine_urls:
            return list(self.config.engine_urls)
        try:
            raw = yield from self._command(Command("hget", (self.key("snapshot"), "engines")), breaker=False)
        except RedisDown:
            return None
        try:
            engines = json.loads(raw.decode() if isinstance(raw, bytes) else raw) if raw else []
        except ValueError:
            return []
        if not isinstance(engines, list):
            return []
        return sorted({e["url"] for e in engines if isinstance(e, dict) and e.get("url")})

    def _close_targets(self, found: list[str] | None, session_id: str) -> tuple[list[str], int]:
        """The URLs a close goes to, and how many closes already failed: malformed URLs (a
        snapshot written by hand), and one for a close that can reach no engine, which is
        logged at warning level at most once per ``WARN_EVERY_S``."""
        urls: list[str] = []
        bad = 0
        for u in found or []:
            try:
                urls.append(normalize_base_url(u))
            except ValueError:
                bad += 1
        if urls or bad:
            return urls, bad
        why = ("the engine list could not be read from Redis" if found is None else
               "no engine URL is known (no snapshot with engine URLs, and no engine_urls knob)")
        with self._lock:
            n = self._close_warn.due(self.clock())
        if not n:
            return urls, 1
        log.warning("gate %s: the close of session %r reached no engine (counted as a failed close): "
                    "%s; %d such close(s) since the last warning", self.name, session_id, why, n)
        return urls, 1

    def record_close(self, attempts: int, failures: int) -> Flow:
        """Count close attempts and failures in the totals, which the step window reads
        (lua/drain_stats.lua; in this process's counters while Redis cannot answer)."""
        cmds = tuple(Command("hincrby", (self.key("totals"), f, n))
                     for f, n in (("close", attempts), ("close_failure", failures)))
        try:
            yield from self._command(Pipeline(cmds))
        except RedisDown:
            with self._lock:
                self.local["close"] += attempts
                self.local["close_failure"] += failures

    def num_preempted(self, session_id: Any) -> Flow:
        """How many waiting attempts of this session newer attempts preempted (0 on faults)."""
        check_session_id(session_id)
        try:
            v = yield from self._command(Command("hget", (self.key("preempted"), session_id)))
        except RedisDown:
            return 0
        return int(v or 0)

    # -- reading and housekeeping ---------------------------------------------------------
    def step_metrics(self, drain: bool = True) -> Flow:
        """The step's flat metrics dict; a peek (``drain=False``) leaves the counters."""
        try:
            raw = yield from self._script("drain_stats", {"drain": 1 if drain else 0})
        except RedisDown:
            raw = None
        with self._lock:
            local = dict(self.local)
            if drain:
                self.local.clear()
        return metrics.build_step_metrics(raw, self.config, local)

    def status(self) -> Flow:
        """The gate's state for operators; Redis errors are raised as they are."""
        raw = yield from self._operator(self.eval_op("drain_stats", {"drain": 0}))
        engines, head, totals = yield from self._operator(Pipeline((
            Command("hget", (self.key("snapshot"), "engines")),
            Command("zrange", (self.key("fifo"), 0, 9), {"withscores": True}),
            Command("hgetall", (self.key("totals"),)))))
        return metrics.build_status(self.name, self.config, raw, engines, head, totals)

    def write_snapshot(self, engines: Sequence[EngineState], budget_scale: float | None = None) -> Flow:
        """Store a capacity snapshot, with the budget scale the poller measured if given
        (docs/budget.md); Redis errors are raised as they are (the poller reports them)."""
        r = yield from self._operator(self.eval_op("write_snapshot", snapshot_params(engines, budget_scale)))
        return SnapshotResult(epoch=int(r["epoch"]), bumped=bool(r["bumped"]), capacity_tokens=int(r["capacity"]),
                              usage=float(r["usage"]), n_healthy=int(r["n_healthy"]))

    def housekeep(self, limit: int = 100) -> Flow:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit must be an int >= 1, got {limit!r}")
        return (yield from self._operator(self.eval_op("housekeep", {"limit": limit})))

    def bump_epoch(self) -> Flow:
        return int((yield from self._operator(self.eval_op("bump_epoch", {})))["epoch"])

    # -- Redis: the breaker and the deferred give-backs -----------------------------------
    def breaker_open(self) -> bool:
        return self.clock() < self._breaker_until

    def trip(self, error: BaseException | None = None) -> None:
        """Open the breaker for ``BREAKER_S``; a fault (``error``) is logged at warning level
        at most once per ``WARN_EVERY_S``, with what it means and how many it stands for."""
        now = self.clock()
        self._breaker_until = now + BREAKER_S
        if error is None:
            return
        with self._lock:
            n = self._fault_warn.due(now)
        if n:
            log.warning("gate %s: %s; meanwhile turns bypass as degraded and releases are kept to send "
                        "later; %d Redis fault(s) since the last warning", self.name, describe_fault(error), n)

    def _note_server(self, reply: Any) -> None:
        """A turn script's reply names the Redis process that ran it (common.lua server_id).
        When that changed, another process serves the gate's state (a promoted replica, a
        restart), which may lack the give-backs the last one confirmed lately: they are
        deferred again (sent before the next call). Both scripts are idempotent per ticket (a
        ticket is never reused), so one that did arrive changes nothing the second time."""
        srv = reply.get("srv") if isinstance(reply, dict) else None
        if srv is None:
            return
        with self._lock:
            changed = self._server is not None and srv != self._server
            self._server = srv
            if not changed:
                return
            replay, self._confirmed = self._confirmed, OrderedDict()
            for ticket, (_, script, params) in replay.items():
                if ticket not in self._deferred:
                    self._deferred[ticket] = (script, params)
                    self.local["replayed"] += 1
            self._drop_oldest()
        log.warning("gate %s: another Redis process answers (a failover or a restart): sending %d recent "
                    "releases, cancels and session finishes again", self.name, len(replay))

    def _confirm(self, ticket: str, script: str, params: dict) -> None:
        """Remember a give-back Redis confirmed, for REPLAY_S after the latest one."""
        now = self.clock()
        with self._lock:
            self._confirmed[ticket] = (now, script, params)
            self._confirmed.move_to_end(ticket)
            while self._confirmed and (len(self._confirmed) > MAX_DEFERRED
                                       or next(iter(self._confirmed.values()))[0] < now - REPLAY_S):
                self._confirmed.popitem(last=False)

    def _script(self, name: str, params: dict) -> Flow:
        """A script call of the turn path: refused while the breaker is open, after the
        deferred give-backs, and a fault trips the breaker. Raises RedisDown."""
        if self.breaker_open():
            raise BreakerOpen("breaker open after a recent Redis fault")
        if self._deferred:
            yield from self.flush()
        try:
            r = yield self.eval_op(name, params)
        except AccessDenied as e:
            raise RedisAccessDenied(str(e), e.error) from e.error
        except RedisDown as e:
            self.trip(e)
            raise
        self._note_server(r)
        return r

    def _command(self, op: Command | Pipeline, breaker: bool = True) -> Flow:
        """Plain commands outside the scripts: skipped while the breaker is open (unless
        ``breaker`` is False); a fault trips it. Raises RedisDown."""
        if breaker and self.breaker_open():
            raise BreakerOpen("breaker open after a recent Redis fault")
        try:
            return (yield op)
        except AccessDenied as e:
            raise RedisAccessDenied(str(e), e.error) from e.error
        except RedisDown as e:
            self.trip(e)
            raise

    @staticmethod
    def _operator(op: Eval | Pipeline) -> Flow:
        """An operator's call: past the breaker, and a fault is raised as the client raised it."""
        try:
            return (yield op)
        except AccessDenied as e:
            raise RedisAccessDenied(str(e), e.error) from e.error
        except RedisDown as e:
            raise (e.error or e) from None

    def _give_back(self, ticket: str, script: str, params: dict) -> Flow:
        """Send a release or cancel; one Redis did not confirm is kept to send later (both are
        idempotent per ticket). The reply, or None when deferred."""
        try:
            r = yield from self._script(script, params)
        except RedisDown:
            self._defer(ticket, script, params)
            return None
        self._confirm(ticket, script, params)
        return r

    def _defer(self, ticket: str, script: str, params: dict) -> None:
        with self._lock:
            if ticket not in self._deferred:
                self.local["deferred"] += 1
            self._deferred[ticket] = (script, params)
            self._deferred.move_to_end(ticket)
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        while len(self._deferred) > MAX_DEFERRED:
            self._deferred.popitem(last=False)
            self.local["deferred_dropped"] += 1

    @property
    def deferred_count(self) -> int:
        return len(self._deferred)

    def flush(self) -> Flow:
        """Send up to ``DEFERRED_BATCH`` deferred give-backs, oldest first. On a fault, or when
        stopped, what was not confirmed is kept (at the front) and BreakerOpen is raised: the
        call that found them is not sent either."""
        with self._lock:
            items = []
            while self._deferred and len(items) < DEFERRED_BATCH:
                t, (script, params) = self._deferred.popitem(last=False)
                items.append((t, script, params))
        done = 0
        try:
            for t, script, params in items:
                try:
                    self._note_server((yield self.eval_op(script, params)))
                except RedisDown as e:
                    self.trip(e)
                    raise BreakerOpen(f"Redis faulted while sending deferred releases: {e}") from e
                self._confirm(t, script, params)  # a failover right after may lose it too
                done += 1
        finally:
            with self._lock:
                for t, script, params in reversed(items[done:]):
                    if t not in self._deferred:
                        self._deferred[t] = (script, params)
                        self._deferred.move_to_end(t, last=False)
                self._drop_oldest()

    def flush_at_close(self) -> Flow:
        """One pass over the deferred give-backs when the breaker is closed (stopping at the
        first fault), so a process that ends right after a blip does not leave its last
        leases charged until ``lease_ttl_s``; none while it is open (a close must not wait
        on a dead Redis)."""
        if not self._deferred or self.breaker_open():
            return
        try:
            for _ in range(-(-len(self._deferred) // DEFERRED_BATCH)):
                yield from self.flush()
        except RedisDown:
            pass

    def _count(self, d: Decision) -> None:
        with self._lock:
            self.local[d.outcome] += 1
            if d.outcome == "bypass":
                self.local["bypass_" + d.reason] += 1
