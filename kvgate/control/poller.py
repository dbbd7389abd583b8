"""The poller: discovers engines, scrapes their ``/metrics``, writes capacity snapshots.

One small process per gate (``kvgate poller ...``), or a library object::

    poller = kvgate.control.poller.Poller(gate, router="http://router:30000")
    poller.run()                      # until poller.stop() / SIGTERM (CLI)

Each tick:

1. leadership: take or extend the leader lease (kvgate/control/lease.py); a standby stops
   here.  A poller that just became leader starts from nothing: numbers of an earlier term
   are not reused.  While the leader's tick runs, the lease is kept alive beside it;
2. discover engines (router ``/workers`` -> ``/list_workers``, or the static list:
   kvgate/control/discovery.py);
3. scrape every engine's ``/metrics`` concurrently (kvgate/control/scrape.py);
4. build one ``EngineState`` per engine (per data-parallel rank) from the scrapes, with the
   rates measured across ticks and a failed scrape bridged by the engine's last usable one
   (kvgate/control/estimates.py);
5. if the lease is still ours, ``gate.write_snapshot`` with the budget scale measured for this
   tick (kvgate/control/budget_reading.py; one atomic script; the core bumps the epoch when
   the healthy set changes).  With no healthy engine (or none listed) the snapshot written
   has none: the healthy set changed, so the epoch bumps, and clients read it as not fresh
   and bypass as ``degraded`` (fail open).  When the router is unreachable *nothing* is
   written (nothing is known): the last snapshot goes stale after ``staleness_s``;
6. ``gate.housekeep(limit=...)`` (reclaim expired leases and windows, drop dead waiters, wake).

Only the leader writes and housekeeps.  Every Redis call of the poller runs on a few threads
of its own, bounded by ``leader_ttl_s / 3`` (kvgate/control/call_threads.py); one that does
not answer in time counts as failed.
See docs/poller.md.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

import httpx
import redis

from kvgate._http import async_client
from kvgate.client.gate import Gate
from kvgate.control.budget_reading import BudgetReader
from kvgate.control.call_threads import CallThreads
from kvgate.control.discovery import DEFAULT_MAX_BODY_BYTES, Discovery, DiscoveryError
# PREFILL_LOAD_WINDOW_S, engine_states, leader_key and ScrapeResult are imported from here by
# users, tests and kvgate/tools/bench/runner.py: this module re-exports them from their homes
from kvgate.control.estimates import PREFILL_LOAD_WINDOW_S, EngineEstimates, engine_states  # noqa: F401
from kvgate.control.lease import LeaderLease, leader_key
from kvgate.control.scrape import ScrapeResult, scrape_engines
from kvgate.errors import RedisAccessDenied

log = logging.getLogger("kvgate.control.poller")

__all__ = ["Poller", "TickResult", "ScrapeResult", "engine_states", "leader_key"]


# the gate knobs the scripts apply on every snapshot write and housekeeping call (FIFO
# advance, trim, staleness, lease and window times): logged at start and in status(), since a
# poller running with other values than the clients grants FIFO heads by its own
WRITE_KNOBS = ("admission", "residency", "headroom", "pressure_threshold", "high_watermark",
               "budget_scale", "staleness_s", "lease_ttl_s", "idle_grace_s",
               "wait_poll_s", "max_wait_s", "max_wait_hard_s", "reap_batch")


@dataclass
class TickResult:
    """What one tick did (for tests, logs, ``kvgate status`` of the poller itself)."""

    leader: bool
    wrote: bool = False
    reason: str = ""  # why nothing was written: standby / router_unreachable / no_healthy_engine / ...
    states: list = field(default_factory=list)
    scrapes: list[ScrapeResult] = field(default_factory=list)
    snapshot: Any = None  # kvgate.SnapshotResult
    housekeep: Any = None
    discovery_error: str | None = None
    seconds: float = 0.0

    @property
    def errors(self) -> dict[str, str]:
        return {s.endpoint.url: s.error for s in self.scrapes if s.error}


class Poller:
    """Discover + scrape + write snapshots for one gate; leader-elected through Redis."""

    def __init__(
        self,
        gate: Gate,
        *,
        router: str | None = None,
        engines: Sequence[str] | None = None,
        interval_s: float = 1.0,
        http_timeout_s: float = 2.0,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        leader_ttl_s: float = 5.0,
        concurrency: int = 32,
        housekeep_limit: int = 100,
        unhealthy_after: int = 2,
        redis_client: redis.Redis | None = None,
        name: str | None = None,
        identity: str | None = None,
    ) -> None:
        if not isinstance(gate, Gate):
            # an AsyncGate's calls are coroutines for its own loop; the poller calls the gate
            # from its own threads and runs its own event loop
            raise ValueError("Poller needs a synchronous kvgate.Gate (it runs its own event loop), "
                             f"got {type(gate).__name__}")
        for nm, v in (("interval_s", interval_s), ("http_timeout_s", http_timeout_s),
                      ("leader_ttl_s", leader_ttl_s)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v < float("inf")):
                raise ValueError(f"{nm} must be a positive finite number, got {v!r}")
        if leader_ttl_s <= interval_s:
            raise ValueError(f"leader_ttl_s ({leader_ttl_s}) must exceed interval_s ({interval_s}), "
                             "or the lease lapses between ticks")
        stale = gate.config.staleness_s
        if interval_s >= stale:
            raise ValueError(f"interval_s ({interval_s}) must be below the gate's staleness_s ({stale}): "
                             "clients would read every snapshot as stale before the next one and "
                             "bypass as degraded")
        if interval_s + http_timeout_s >= stale:
            log.warning("interval_s (%s) + http_timeout_s (%s) >= staleness_s (%s): one slow scrape "
                        "leaves clients without a fresh snapshot (degraded)", interval_s,
                        http_timeout_s, stale)
        for nm, v in (("concurrency", concurrency), ("housekeep_limit", housekeep_limit),
                      ("max_body_bytes", max_body_bytes), ("unhealthy_after", unhealthy_after)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{nm} must be an int >= 1, got {v!r}")
        self.discovery = Discovery(router=router, engines=engines, timeout_s=http_timeout_s,
                                   max_body_bytes=max_body_bytes)
        self.gate = gate
        self.interval_s = float(interval_s)
        self.http_timeout_s = float(http_timeout_s)
        self.max_body_bytes = max_body_bytes
        self.leader_ttl_s = float(leader_ttl_s)
        self.concurrency = concurrency
        self.housekeep_limit = housekeep_limit
        self.unhealthy_after = unhealthy_after
        self.name = name or gate.name
        self.redis = redis_client if redis_client is not None else gate.redis
        self.identity = identity or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        # every Redis call of the poller returns within this (a third of the lease): one slower
        # than that counts as failed, as a Redis error does
        self.redis_call_timeout_s = self.leader_ttl_s / 3
        self.calls = CallThreads(bound_s=self.redis_call_timeout_s)
        self.lease = LeaderLease(self.redis, self.name, identity=self.identity, ttl_s=self.leader_ttl_s,
                                 calls=self.calls)
        self.estimates = EngineEstimates(unhealthy_after)
        self.budget_reader = BudgetReader(self.redis, self.name, gate.config, self.calls)
        self._staleness_s = stale
        self._none_healthy = False  # the last snapshot written had no healthy engine
        self.last: TickResult | None = None
        self.ticks = 0
        self.writes = 0
        self.scrape_errors = 0
        self._stop = threading.Event()
        self.knobs = {k: getattr(gate.config, k) for k in WRITE_KNOBS}
        log.info("poller %s for gate %s writes snapshots with the gate knobs %s (clients must use the "
                 "same: docs/poller.md#gate-knobs)", self.identity, self.name,
                 " ".join(f"{k}={v}" for k, v in self.knobs.items()))

    # -- what the lease and the estimates know -----------------------------------------------
    @property
    def is_leader(self) -> bool:
        return self.lease.is_leader

    @property
    def holds_lease(self) -> bool:
        """Leader at the last check, and the lease's TTL has not run out since on this
        poller's own clock (a poller that stalled past it may have lost the lease)."""
        return self.lease.held

    @property
    def leader_changes(self) -> int:
        return self.lease.changes

    @property
    def scrapes_bridged(self) -> int:
        return self.estimates.scrapes_bridged

    @property
    def prefill_load_pending(self) -> bool:
        """True while an engine exports prefill time (vLLM) but its first load window
        (PREFILL_LOAD_WINDOW_S) has not closed: the snapshot says "not measured" until then."""
        return self.estimates.load_pending

    def leader_identity(self) -> str | None:
        """Who holds the lease (``host:pid:random``), or None (none, or Redis did not answer
        within ``redis_call_timeout_s``)."""
        return self.lease.holder()

    def release(self) -> None:
        """Give up the lease at once (graceful shutdown: a standby takes over next tick).
        Bounded by ``redis_call_timeout_s``; on a Redis that does not answer, the lease is
        left to expire."""
        self.lease.release()

    # -- one tick -------------------------------------------------------------------------
    async def atick(self, client: httpx.AsyncClient | None = None) -> TickResult:
        t0 = time.monotonic()
        self.ticks += 1
        was = self.lease.is_leader
        if not await self.lease.hold():
            res = TickResult(leader=False, reason="standby", seconds=time.monotonic() - t0)
            self.last = res
            return res
        if not was:
            # a new term: what this poller measured before is not fresh (docs/poller.md#one-tick)
            self.estimates.forget()
            self.budget_reader.new_term()
        own = client is None
        if own:
            client = async_client(trust_env=False)
        keeper = asyncio.create_task(self.lease.keep_alive())
        try:
            res = await self._lead_tick(client)
        finally:
            keeper.cancel()
            if own:
                await client.aclose()
        res.seconds = time.monotonic() - t0
        if res.seconds > self._staleness_s:
            log.warning("the tick took %.1fs, longer than staleness_s (%s): clients read the snapshot as "
                        "stale meanwhile; scraping takes up to ceil(engines / --concurrency) x "
                        "--http-timeout: raise --concurrency or lower --http-timeout", res.seconds,
                        self._staleness_s)
        self.last = res
        return res

    async def _collect(self, client: httpx.AsyncClient, res: TickResult, *, fenced: bool) -> bool:
        """Discover and scrape into ``res``; False when the tick must stop (router unusable,
        or, when ``fenced``, the lease was lost after discovery)."""
        try:
            endpoints = await self.discovery.discover(client)
        except DiscoveryError as e:
            res.discovery_error = str(e)
            res.reason = "router_unreachable"
            log.warning("%s", e)
            return False
        if fenced and not await self.lease.hold():  # discovery may have taken two request deadlines
            res.leader = False
            res.reason = "lost_lease"
            return False
        scrapes = await scrape_engines(client, endpoints, concurrency=self.concurrency,
                                       timeout_s=self.http_timeout_s, max_body_bytes=self.max_body_bytes)
        res.scrapes = scrapes
        self.scrape_errors += sum(1 for s in scrapes if s.error)
        for s in scrapes:
            if s.error:
                log.info("engine %s: scrape failed: %s", s.endpoint.url, s.error)
        res.states = self.estimates.states(scrapes)
        if not any(st.healthy for st in res.states):
            # still written: the healthy set is now empty (the epoch bumps, and again when
            # engines come back, restarted with empty caches), and clients read a snapshot
            # without a healthy engine as not fresh (degraded)
            res.reason = "no_healthy_engine" if endpoints else "no_engines"
        return True

    async def aobserve(self, client: httpx.AsyncClient | None = None) -> TickResult:
        """Discover and scrape once; no lease, no write, no housekeeping (``--dry-run``)."""
        res = TickResult(leader=False)
        t0 = time.monotonic()
        if client is None:
            async with async_client(trust_env=False) as c:
                await self._collect(c, res, fenced=False)
        else:
            await self._collect(client, res, fenced=False)
        res.seconds = time.monotonic() - t0
        return res

    def observe(self) -> TickResult:
        return asyncio.run(self.aobserve())

    async def _lead_tick(self, client: httpx.AsyncClient) -> TickResult:
        res = TickResult(leader=True)
        if not await self._collect(client, res, fenced=True):
            if res.leader:
                await self._housekeep(res)
            return res
        # Fence: scraping took time; write only if the lease is still ours.
        if not await self.lease.hold():
            res.leader = False
            res.reason = "lost_lease"
            return res
        scale = await self.budget_reader.measure(res.scrapes)
        try:
            res.snapshot = await self.calls.call(self.gate.write_snapshot, res.states, scale)
            res.wrote = True
            self.writes += 1
        except RedisAccessDenied:
            raise  # a configuration error: arun stops on it
        except Exception as e:  # noqa: BLE001 - Redis down, script errors: never kill the loop
            res.reason = f"write_failed: {type(e).__name__}: {e}"
            log.warning("write_snapshot failed: %s: %s", type(e).__name__, e)
        else:
            none = not any(st.healthy for st in res.states)
            if none and not self._none_healthy:
                log.warning("no healthy engine: wrote a snapshot without one (clients bypass as degraded "
                            "until an engine is back)")
            elif self._none_healthy and not none:
                log.info("healthy engines again: %d", res.snapshot.n_healthy)
            self._none_healthy = none
        await self._housekeep(res)
        return res

    def _housekeep_redis(self) -> Any:
        return self.gate.housekeep(limit=self.housekeep_limit)

    async def _housekeep(self, res: TickResult) -> None:
        try:
            res.housekeep = await self.calls.call(self._housekeep_redis)
        except RedisAccessDenied:
            raise
        except Exception as e:  # noqa: BLE001 - Redis down, script errors: next tick retries
            log.warning("housekeep failed: %s: %s", type(e).__name__, e)

    def tick(self) -> TickResult:
        """One synchronous tick (own event loop)."""
        return asyncio.run(self.atick())

    # -- loop -----------------------------------------------------------------------------
    async def arun(self, *, max_ticks: int | None = None) -> None:
        async with async_client(trust_env=False) as client:
            next_at = time.monotonic()
            n = 0
            try:
                while not self._stop.is_set():
                    try:
                        await self.atick(client)
                    except RedisAccessDenied:
                        raise  # no tick can succeed until the ACL is fixed: stop, and say why
                    except Exception:  # noqa: BLE001 - the loop survives anything else a tick throws
                        log.exception("poller tick failed")
                    n += 1
                    if max_ticks is not None and n >= max_ticks:
                        break
                    next_at += self.interval_s
                    delay = next_at - time.monotonic()
                    if delay < 0:  # overran: do not burst to catch up
                        next_at = time.monotonic()
                        delay = 0
                    await self._sleep(delay)
            finally:
                await self.lease.arelease()

    async def _sleep(self, delay: float) -> None:
        """Sleep up to ``delay`` seconds, waking early when :meth:`stop` is called."""
        end = time.monotonic() + delay
        while not self._stop.is_set():
            left = end - time.monotonic()
            if left <= 0:
                return
            await asyncio.sleep(min(left, 0.05))

    def run(self, *, max_ticks: int | None = None) -> None:
        """Tick every ``interval_s`` until :meth:`stop` (or ``max_ticks``); releases the lease
        on the way out."""
        asyncio.run(self.arun(max_ticks=max_ticks))

    def stop(self) -> None:
        self._stop.set()

    def status(self) -> dict:
        last = self.last
        return {
            "identity": self.identity, "leader": self.holds_lease, "ticks": self.ticks,
            "writes": self.writes, "leader_changes": self.leader_changes,
            "scrape_errors": self.scrape_errors, "scrapes_bridged": self.scrapes_bridged,
            "last_reason": last.reason if last else None,
            "last_errors": last.errors if last else {},
            "knobs": dict(self.knobs),
        }
