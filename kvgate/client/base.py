"""What the sync and async gates share: naming, parameters, decoding, local counters."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import json
import logging
import os
import threading
import time
from collections import Counter, OrderedDict
from typing import Any, Callable, Sequence

import redis

from .. import keys as _keys
from .flows import BreakerOpen, Decision, TurnRequest, build_request, knob_params
from ..config import GateConfig
from .metrics import build_step_metrics
from .probe import ProbeResult
from .scripts import SCRIPT_NAMES, script_source
from .snapshot import EngineState, SnapshotResult
from .._urls import normalize_base_url

#: after a Redis fault, turns bypass as degraded without calling Redis for this long,
#: so a dead Redis costs one timeout per breaker period, not one per turn
BREAKER_S = 1.0

#: sessions whose last turn end this process remembers (for the tool gap it reports)
MAX_TRACKED_SESSIONS = 65536

#: releases and cancels that could not reach Redis, kept to send once it answers again
#: (oldest dropped past this: their leases are then reclaimed by ``lease_ttl_s``)
# what counts as a Redis fault for both drivers (the async one adds its own deadline).
# RedisClusterException is a plain Exception in redis-py, not a RedisError: a cluster client
# raises it when no node answers while it rebuilds its node map
REDIS_ERRORS = (redis.RedisError, redis.exceptions.RedisClusterException, OSError)
MAX_DEFERRED = 4096

#: most deferred operations one call sends before its own script
DEFERRED_BATCH = 32

#: the scripts that give back what a ticket holds; idempotent per ticket, so sending one
#: again (after a reply was lost) or late (after Redis came back) is safe
GIVE_BACK = ("release", "cancel")


#: threads that run a blocking probe; a probe still running past its timeout keeps its thread
PROBE_THREADS = 4

#: a gate logs a session close that went to no engine at most once per this many seconds
#: (it is counted every time, in ``close_failure``)
CLOSE_WARN_EVERY_S = 60.0

log = logging.getLogger("kvgate")


class GateBase:
    def __init__(self, gate: str, config: GateConfig | None, probe: Any,
                 clock_ms: Callable[[], int] | None):
        self.name = _keys.validate_gate_name(gate)
        if config is None:
            # no config given: the knobs come from KVGATE_* over the defaults (SPEC section 6;
            # docs/decisions.md#config-from-env); GateConfig() is the way to ignore the env
            config = GateConfig.from_env()
        if not isinstance(config, GateConfig):
            raise ValueError(f"config must be a kvgate.GateConfig, got {type(config).__name__}")
        self.config = config
        self.probe = probe
        self._clock_ms = clock_ms
        self._keys = _keys.script_keys(self.name)
        self.channel = _keys.channel(self.name)
        self._knobs = knob_params(config, self.channel)
        self._breaker_until = 0.0
        # releases and cancels Redis has not confirmed: ticket -> (script, params); sent
        # before the next script call once the breaker is closed (docs/concepts.md#failing-open)
        self._deferred: OrderedDict[str, tuple[str, dict]] = OrderedDict()
        self._local = Counter()          # outcomes decided without Redis (pass, degraded on faults)
        self._local_lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # blocking probes (_submit_probe)
        self._probes_running = 0
        self._pool_pid = os.getpid()  # a child of os.fork() inherits a pool whose threads it has not
        # the client is closed by close()/aclose() only when the gate built it (from_url): a
        # client passed in is the caller's, and may serve other gates
        self._owns_client = False
        self._turns = Counter()          # per-session turn counter when the caller gives no index
        self._last_end: OrderedDict[str, float] = OrderedDict()  # session -> monotonic end of its last turn
        self._sources = {n: script_source(n) for n in SCRIPT_NAMES}
        self._close_warned_at: float | None = None  # monotonic time of the last "closed nowhere" log
        self._close_unlogged = 0  # closes that went nowhere since that log

    def _deadline_s(self) -> float:
        """The bound on one Redis call (connect + reply, and some slack): the async gate's
        deadline on each call, the sync close()'s wait for calls on the wire."""
        return self.config.redis_timeout_s * 2 + 0.5

    def _close_targets(self, found: list[str] | None, session_id: str) -> tuple[list[str], int]:
        """The URLs a session's close goes to, and how many closes already failed: bad URLs,
        and one for a close that can reach no engine (the engine list could not be read, or
        there is none: no snapshot yet, no URL in it, no ``engine_urls``), which is logged at
        warning level, at most once per ``CLOSE_WARN_EVERY_S`` per gate."""
        urls, bad = closable_urls(found or [])
        if not urls and not bad:
            why = ("the engine list could not be read from Redis" if found is None else
                   "no engine URL is known (no snapshot with engine URLs, and no engine_urls knob)")
            self._closed_nowhere(session_id, why)
            bad = 1
        return urls, bad

    def _closed_nowhere(self, session_id: str, why: str) -> None:
        now = time.monotonic()
        with self._local_lock:
            self._close_unlogged += 1
            if self._close_warned_at is not None and now - self._close_warned_at < CLOSE_WARN_EVERY_S:
                return
            self._close_warned_at, n = now, self._close_unlogged
            self._close_unlogged = 0
        log.warning("gate %s: the close of session %r reached no engine (counted as a failed close): "
                    "%s; %d such close(s) since the last warning", self.name, session_id, why, n)

    # -- probes -------------------------------------------------------------------------
    def _submit_probe(self, fn: Callable, session_id: str,
                      prompt_ids: Any) -> "concurrent.futures.Future | ProbeResult":
        """Run a blocking ``probe.probe`` on the gate's own pool of ``PROBE_THREADS``: a
        future, or an unavailable result at once when every probe thread is still busy (a
        probe hanging past its timeout keeps its thread) or the gate is closed. Both drivers
        use it: the async gate must not lend the event loop's default executor to a probe,
        which redis-py's asyncio client needs to resolve host names."""
        with self._local_lock:
            if self._pool_pid != os.getpid():  # forked: the pool's threads stayed in the parent
                self._pool, self._probes_running, self._pool_pid = None, 0, os.getpid()
            if self._probes_running >= PROBE_THREADS:
                return ProbeResult(None, detail="probe failed: all probe threads busy")
            self._probes_running += 1
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=PROBE_THREADS,
                                                                   thread_name_prefix="kvgate-probe")
        try:
            fut = self._pool.submit(fn, session_id, prompt_ids)
        except RuntimeError as e:  # the gate was closed
            self._probe_done(None)
            return ProbeResult(None, detail=f"probe failed: {e}")
        fut.add_done_callback(self._probe_done)
        return fut

    def _probe_done(self, _fut: Any) -> None:
        with self._local_lock:
            self._probes_running -= 1

    def _shutdown_probe_pool(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # -- helpers ------------------------------------------------------------------------
    def key(self, name: str) -> str:
        return _keys.key(self.name, name)

    def _args(self, params: dict) -> list[str]:
        now = "" if self._clock_ms is None else str(int(self._clock_ms()))
        return [now, json.dumps({**self._knobs, **params}, separators=(",", ":"))]

    def _breaker_open(self) -> bool:
        return time.monotonic() < self._breaker_until

    def _trip(self) -> None:
        self._breaker_until = time.monotonic() + BREAKER_S

    def _defer(self, ticket: str, script: str, params: dict) -> None:
        """Keep a release or cancel that did not reach Redis (or whose reply was lost) to send
        later. A cancel supersedes nothing it should not: both give back all the ticket holds."""
        with self._local_lock:
            if ticket not in self._deferred:
                self._local["deferred"] += 1
            self._deferred[ticket] = (script, params)
            self._deferred.move_to_end(ticket)
            while len(self._deferred) > MAX_DEFERRED:
                self._deferred.popitem(last=False)
                self._local["deferred_dropped"] += 1

    def _eval_failed(self, ticket: str, script: str, params: dict, err: Exception, sent: bool) -> bool:
        """An acquire driver's script call failed with ``err`` (a RedisDown): whether anything of
        this ticket may now be in Redis. A refusal by the open breaker sent nothing; any other
        failure may have reached Redis, so the ticket's waiter record or lease is given back
        later (a failed cancel is retried as it was)."""
        sent = sent or not isinstance(err, BreakerOpen)
        if sent:
            self._defer(ticket, "cancel", params if script == "cancel" else {"ticket": ticket})
        return sent

    def _close_flushes(self) -> int:
        """How many flushes close() makes: one pass over the deferred releases and cancels when
        the breaker is closed (each stops at the first fault), so a process that ends right
        after a blip does not leave its last leases charged in the shared ledger until
        lease_ttl_s; none while the breaker is open (close() must not wait on a dead Redis)."""
        if not self._deferred or self._breaker_open():
            return 0
        return -(-len(self._deferred) // DEFERRED_BATCH)

    def _take_deferred(self) -> list[tuple[str, str, dict]]:
        with self._local_lock:
            out = []
            while self._deferred and len(out) < DEFERRED_BATCH:
                t, (script, params) = self._deferred.popitem(last=False)
                out.append((t, script, params))
            return out

    def _undo_take(self, items: list[tuple[str, str, dict]]) -> None:
        """Put back what a failed flush took (at the front: they are the oldest)."""
        with self._local_lock:
            for t, script, params in reversed(items):
                if t not in self._deferred:
                    self._deferred[t] = (script, params)
                    self._deferred.move_to_end(t, last=False)
            while len(self._deferred) > MAX_DEFERRED:
                self._deferred.popitem(last=False)
                self._local["deferred_dropped"] += 1

    @property
    def deferred_count(self) -> int:
        """Releases and cancels waiting for Redis to answer again (0 while it is healthy)."""
        return len(self._deferred)

    def _count_local(self, d: Decision) -> None:
        with self._local_lock:
            self._local[d.outcome] += 1
            if d.outcome == "bypass":
                self._local["bypass_" + d.reason] += 1

    def _count_unseen(self, d: Decision) -> None:
        """Count the outcomes Redis could not: pass-through, and bypasses decided without it
        (Redis unreachable; those carry no epoch)."""
        if d.outcome == "pass" or (d.outcome == "bypass" and d.epoch < 0):
            self._count_local(d)

    def _request(self, session_id: Any, kw: dict) -> TurnRequest:
        req = build_request(self.config, session_id, **kw)
        changes: dict[str, Any] = {}
        with self._local_lock:
            if req.turn_index is None:
                changes["turn_index"] = self._turns[req.session_id]
                self._turns[req.session_id] += 1
            # the time this session spent away (its tool call) since its last turn ended here;
            # taken once, so a retry of this turn does not report it again
            ended = self._last_end.pop(req.session_id, None)
        if ended is not None:
            changes["gap_s"] = max(0.0, time.monotonic() - ended)
        return dataclasses.replace(req, **changes) if changes else req

    def _turn_ended(self, session_id: str) -> None:
        with self._local_lock:
            self._last_end[session_id] = time.monotonic()
            self._last_end.move_to_end(session_id)
            while len(self._last_end) > MAX_TRACKED_SESSIONS:
                self._last_end.popitem(last=False)

    def _forget_session(self, session_id: str) -> None:
        with self._local_lock:
            self._turns.pop(session_id, None)
            self._last_end.pop(session_id, None)

    @staticmethod
    def _decode(raw: Any) -> dict:
        if isinstance(raw, bytes):
            raw = raw.decode()
        return json.loads(raw)

    @staticmethod
    def _snapshot_params(engines: Sequence[EngineState], budget_scale: float | None = None) -> dict:
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

    @staticmethod
    def _snapshot_result(r: dict) -> SnapshotResult:
        return SnapshotResult(epoch=int(r["epoch"]), bumped=bool(r["bumped"]),
                              capacity_tokens=int(r["capacity"]), usage=float(r["usage"]),
                              n_healthy=int(r["n_healthy"]))

    def _step_metrics(self, raw: dict | None, drain: bool = True) -> dict[str, float]:
        # a peek (drain=False) leaves this process's own counters for the step's real drain
        with self._local_lock:
            local = dict(self._local)
            if drain:
                self._local.clear()
        return build_step_metrics(raw, self.config, local)

    def _status(self, raw: dict, engines_json: Any, head: list, totals: dict) -> dict:
        """Digest drain_stats.lua's reply (read with drain=0, Redis clock) and a few reads."""
        def txt(v: Any) -> Any:
            return v.decode() if isinstance(v, bytes) else v
        cap = int(raw.get("capacity", 0) or 0)
        ceiling = int(raw.get("ceiling", 0) or 0)  # capacity x headroom x the budget scale
        reserved = int(raw.get("reserved", 0) or 0)
        age_ms = float(raw.get("snapshot_age_ms", -1))
        age = age_ms / 1000.0 if age_ms >= 0 else None
        try:
            engines = json.loads(txt(engines_json)) if engines_json else []
        except ValueError:
            engines = []
        if not isinstance(engines, list):
            engines = []
        fresh = age is not None and age <= self.config.staleness_s and int(raw.get("n_healthy", 0) or 0) > 0
        hit = float(raw.get("hit_rate", -1))
        pst = float(raw.get("prefill_s_per_token", -1))
        pl = float(raw.get("prefill_load", -1))
        gap = float(raw.get("tool_gap_s", -1))
        return {
            "gate": self.name, "reserved": reserved, "ceiling": ceiling, "capacity": cap,
            "available": max(0, ceiling - reserved), "usage": float(raw.get("usage", 0) or 0),
            "epoch": int(raw.get("epoch", 0) or 0), "waiting": int(raw.get("waiting", 0)),
            "leases": int(raw.get("leases", 0)), "windows": int(raw.get("windows", 0)),
            "snapshot_age_s": age, "degraded": not fresh, "hit_rate": hit if hit >= 0 else None,
            "prefill_s_per_token": pst if pst >= 0 else None, "prefill_load": pl if pl >= 0 else None,
            "tool_gap_s": gap if gap >= 0 else None,
            "budget_scale": float(raw.get("budget_scale", 1) or 1),
            "preempted_sessions": int(raw.get("preempted_sessions", 0) or 0),
            "preempted_max": int(raw.get("preempted_max", 0) or 0),
            "engines": engines, "fifo_head": [txt(t) for t, _ in head],
            "totals": {txt(k): float(v) for k, v in totals.items()},
        }


class LeaseBase:
    """What both lease classes record about a decided attempt."""

    def __init__(self, gate: Any, req: TurnRequest, d: Decision):
        self._gate = gate
        self.session_id = req.session_id
        self.ticket = req.ticket
        self.turn_index = req.turn_index
        self.outcome = d.outcome
        self.reason = d.reason
        self.waited_s = d.waited_s
        self.tokens = d.tokens
        self.epoch = d.epoch
        self.held = d.held
        self.released = not d.held
        self._ended = d.outcome == "pass"   # a pass-through turn reports no gap
        self._t0 = time.monotonic()

    @property
    def admitted(self) -> bool:
        return self.outcome == "admit"

    def _begin_release(self) -> bool:
        """Mark released; True when this call must give the lease back."""
        if not self._ended:  # the turn is over, held or not: the session's tool gap starts now
            self._ended = True
            self._gate._turn_ended(self.session_id)
        if self.released:
            return False
        self.released = True
        return True

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(session={self.session_id!r}, outcome={self.outcome!r}, "
                f"reason={self.reason!r}, waited_s={self.waited_s:.3f}, tokens={self.tokens}, "
                f"ticket={self.ticket!r})")


def closable_urls(urls: Sequence[str]) -> tuple[list[str], int]:
    """The URLs a close can go to, and how many it cannot (malformed, e.g. in a snapshot a
    user wrote by hand): those count as failed closes, never as an error at the session's end."""
    good: list[str] = []
    bad = 0
    for u in urls:
        try:
            good.append(normalize_base_url(u))
        except ValueError:
            bad += 1
    return good, bad


def engine_urls_from(config: GateConfig, engines_json: Any) -> list[str]:
    if config.engine_urls:
        return list(config.engine_urls)
    if not engines_json:
        return []
    if isinstance(engines_json, bytes):
        engines_json = engines_json.decode()
    try:
        engines = json.loads(engines_json)
    except ValueError:
        return []
    if not isinstance(engines, list):
        return []
    return sorted({e["url"] for e in engines if isinstance(e, dict) and e.get("url")})
