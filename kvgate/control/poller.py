"""The poller: discovers engines, scrapes their ``/metrics``, writes capacity snapshots.

One small process per gate (``kvgate poller ...``), or a library object::

    poller = kvgate.control.poller.Poller(gate, router="http://router:30000")
    poller.run()                      # until poller.stop() / SIGTERM (CLI)

Each tick:

1. leadership: take or extend the leader lease (kvgate/control/lease.py); a standby stops
   here.  A poller that just became leader starts from nothing: numbers of an earlier term
   are not reused.  While the leader's tick runs, the lease is kept alive beside it;
2. discover engines (router ``/workers`` -> ``/list_workers``, or the static list);
3. scrape every engine's ``/metrics`` concurrently (bounded concurrency, an overall deadline and
   a body-size cap per request);
4. build one ``EngineState`` per engine (per data-parallel rank); an engine the router marks
   unhealthy is ``healthy=False``, and so is one whose scrape failed (no answer, garbage)
   ``unhealthy_after`` times in a row (default 2: until then its last usable scrape stands
   in, so one timeout does not bump the epoch and end every ownership window);
5. if the lease is still ours, ``gate.write_snapshot`` (one atomic script; the core bumps the
   epoch when the healthy set changes).  With no healthy engine (or none listed) the snapshot
   written has none: the healthy set changed, so the epoch bumps, and clients read it as not
   fresh and bypass as ``degraded`` (fail open).  When the router is unreachable *nothing* is
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

from kvgate import keys
from kvgate._http import async_client
from kvgate.client.gate import Gate
from kvgate.control.call_threads import CallThreads
# leader_key is imported from here by users and tests: re-exported from its home
from kvgate.control.lease import LeaderLease, leader_key
from kvgate.control.discovery import (
    DEFAULT_MAX_BODY_BYTES,
    Discovery,
    DiscoveryError,
    Endpoint,
    HttpError,
    fetch_limited,
)
from kvgate.control.budget import BudgetController, Reading
from kvgate.control.promparse import EngineMetrics, MetricsParseError, parse_metrics

log = logging.getLogger("kvgate.control.poller")

__all__ = ["Poller", "TickResult", "ScrapeResult", "engine_states", "leader_key"]


# an interval with fewer newly computed prompt tokens than this does not update the estimate
PREFILL_MIN_TOKENS = 256
# the prefill load is measured over windows of at least this many seconds
PREFILL_LOAD_WINDOW_S = 2.0

# the gate knobs the scripts apply on every snapshot write and housekeeping call (FIFO
# advance, trim, staleness, lease and window times): logged at start and in status(), since a
# poller running with other values than the clients grants FIFO heads by its own
WRITE_KNOBS = ("admission", "residency", "headroom", "pressure_threshold", "high_watermark",
               "budget_scale", "staleness_s", "lease_ttl_s", "idle_grace_s",
               "wait_poll_s", "max_wait_s", "max_wait_hard_s", "reap_batch")

@dataclass
class ScrapeResult:
    endpoint: Endpoint
    metrics: EngineMetrics | None = None
    error: str | None = None
    seconds: float = 0.0


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


def _engine_state_cls():
    from kvgate.client.snapshot import EngineState

    return EngineState


def engine_states(scrapes: Sequence[ScrapeResult], *, hit_rates: dict[str, float] | None = None,
                  known_ids: dict[str, list[str]] | None = None,
                  prefill_costs: dict[str, float] | None = None,
                  prefill_loads: dict[str, float] | None = None) -> list:
    """``EngineState`` list from scrape results.

    One state per data-parallel rank; a single-rank engine's id is its base URL, a DP rank's id
    is ``<url>#dp<rank>``.  A failed or unhealthy endpoint yields ``healthy=False`` states for
    the ids it had last time (so the healthy set visibly changes), or for its URL.
    """
    EngineState = _engine_state_cls()
    hit_rates = hit_rates or {}
    prefill_costs = prefill_costs or {}
    prefill_loads = prefill_loads or {}
    known_ids = known_ids if known_ids is not None else {}
    out = []
    seen: set[str] = set()
    for s in scrapes:
        url = s.endpoint.url
        if s.metrics is None:
            for eid in known_ids.get(url) or [url]:
                if eid not in seen:
                    seen.add(eid)
                    out.append(EngineState(engine_id=eid, capacity_tokens=0, healthy=False, url=url,
                                           kind=_kind_guess(s)))
            continue
        ranks = s.metrics.ranks
        ids = []
        for r in ranks:
            eid = _rank_id(url, ranks, r)
            if eid in seen:
                continue
            seen.add(eid)
            ids.append(eid)
            try:
                st = EngineState(engine_id=eid, capacity_tokens=int(r.capacity_tokens),
                                 used_tokens=r.used_tokens, usage=r.usage, healthy=True,
                                 hit_rate=hit_rates.get(eid, r.hit_rate), url=url, kind=r.kind,
                                 prefill_s_per_token=prefill_costs.get(eid),
                                 prefill_load=prefill_loads.get(eid))
            except ValueError as e:  # values the core rejects: this engine only is unhealthy
                log.info("engine %s: unusable metrics: %s", eid, e)
                st = EngineState(engine_id=eid, capacity_tokens=0, healthy=False, url=url, kind=r.kind)
            out.append(st)
        known_ids[url] = ids
    return out


def _rank_id(url: str, ranks: Sequence, r: Any) -> str:
    """A single-rank engine is its URL; a data-parallel rank is ``<url>#dp<rank>``."""
    return url if len(ranks) == 1 else f"{url}#dp{r.dp_rank}"


def _scraped_ranks(scrapes: Sequence[ScrapeResult]):
    """(engine id, RankMetrics) of every rank that was scraped (ids as in ``engine_states``)."""
    for s in scrapes:
        if s.metrics is None:
            continue
        ranks = s.metrics.ranks
        for r in ranks:
            yield _rank_id(s.endpoint.url, ranks, r), r


def _kind_guess(s: ScrapeResult) -> str:
    return "vllm" if (s.endpoint.worker_type or "").startswith("vllm") else "sglang"


def _cache_counters(res: "TickResult") -> tuple:
    """The healthy engines' prefix-cache lookups and hits, summed over this tick's scrapes:
    (queries, hits); (None, None) when an engine does not export them; (False, False) when a
    scrape failed (its last numbers are older than the others')."""
    queries = hits = 0.0
    for s in res.scrapes:
        if s.metrics is None:
            if s.endpoint.healthy:
                return False, False
            continue
        for r in s.metrics.ranks:
            if r.prefix_cache_queries is None or r.prefix_cache_hits is None:
                return None, None
            queries += r.prefix_cache_queries
            hits += r.prefix_cache_hits
    return queries, hits


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


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
        self._staleness_s = stale
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
        self._none_healthy = False  # the last snapshot written had no healthy engine
        self.last: TickResult | None = None
        self.ticks = 0
        self.writes = 0
        self.scrape_errors = 0
        self._stop = threading.Event()
        self._known_ids: dict[str, list[str]] = {}
        self._counters: dict[str, tuple[float, float]] = {}  # engine id -> (hits, queries)
        self._hit_rates: dict[str, float] = {}
        self._prefill_sums: dict[str, tuple[float, float]] = {}  # engine id -> (seconds, tokens)
        self._load_base: dict[str, tuple[float, float]] = {}  # engine id -> (seconds, at)
        self._prefill_loads: dict[str, float] = {}  # engine id -> prefill seconds per wall second
        self._prefill_costs: dict[str, float] = {}  # engine id -> smoothed s per uncached token
        self._last_good: dict[str, EngineMetrics] = {}  # engine URL -> its last usable scrape
        self._failed_in_a_row: dict[str, int] = {}  # engine URL -> consecutive failed scrapes
        self.scrapes_bridged = 0
        # the self-sizing budget (docs/budget.md): measured here, published with each snapshot,
        # unless the gate's config fixes the scale or has no ledger (admission off)
        self.measures_budget = bool(gate.config.admission) and gate.config.budget_scale is None
        self.budget: BudgetController | None = None  # made at the start of each term
        self._budget_epoch: int | None = None
        self.knobs = {k: getattr(gate.config, k) for k in WRITE_KNOBS}
        log.info("poller %s for gate %s writes snapshots with the gate knobs %s (clients must use the "
                 "same: docs/poller.md#gate-knobs)", self.identity, self.name,
                 " ".join(f"{k}={v}" for k, v in self.knobs.items()))

    def _new_term(self) -> None:
        """Forget every engine's numbers: this poller just became leader, and what it measured
        before (its last term, maybe an hour ago) is not fresh.  A failed scrape is then not
        bridged with an old usage, and rates (prefill load, hit rate, prefill cost) start over
        instead of averaging across the time it stood by."""
        for d in (self._known_ids, self._counters, self._hit_rates, self._prefill_sums, self._load_base,
                  self._prefill_loads, self._prefill_costs, self._last_good, self._failed_in_a_row):
            d.clear()
        self.budget = None  # the next budget reading starts from the scale the gate publishes now

    # -- what the lease knows -----------------------------------------------------------------
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
    async def _scrape(self, client: httpx.AsyncClient, sem: asyncio.Semaphore, ep: Endpoint) -> ScrapeResult:
        if not ep.healthy:
            return ScrapeResult(ep, error="router reports the worker unhealthy" +
                                (" (draining)" if ep.draining else ""))
        t0 = time.monotonic()
        async with sem:
            try:
                body = await fetch_limited(client, ep.url + "/metrics", timeout_s=self.http_timeout_s,
                                           max_body_bytes=self.max_body_bytes)
                text = body.decode("utf-8", errors="replace")
                m = parse_metrics(text)
            except (HttpError, MetricsParseError) as e:
                return ScrapeResult(ep, error=str(e), seconds=time.monotonic() - t0)
            except Exception as e:  # noqa: BLE001 - a bad engine never kills the poller
                return ScrapeResult(ep, error=f"{type(e).__name__}: {e}", seconds=time.monotonic() - t0)
        return ScrapeResult(ep, metrics=m, seconds=time.monotonic() - t0)

    def _update_hit_rates(self, scrapes: Sequence[ScrapeResult]) -> None:
        """Interval hit rate from vLLM's cumulative counters (delta hits / delta queries);
        the cumulative ratio when there is no usable previous sample."""
        for eid, r in _scraped_ranks(scrapes):
            if r.prefix_cache_hits is None or r.prefix_cache_queries is None:
                self._hit_rates.pop(eid, None)
                continue
            prev = self._counters.get(eid)
            self._counters[eid] = (r.prefix_cache_hits, r.prefix_cache_queries)
            if prev is not None:
                dh, dq = r.prefix_cache_hits - prev[0], r.prefix_cache_queries - prev[1]
                if dq > 0 and 0 <= dh <= dq:
                    self._hit_rates[eid] = dh / dq
                    continue
                if dq == 0 and eid in self._hit_rates:
                    continue  # idle interval: keep the last rate
            if r.hit_rate is not None:
                self._hit_rates[eid] = r.hit_rate
            else:
                self._hit_rates.pop(eid, None)

    def _update_prefill_costs(self, scrapes: Sequence[ScrapeResult]) -> None:
        """Seconds of prefill per uncached prompt token, from vLLM's per-request histogram sums
        (``request_prefill_time_seconds`` over ``request_prefill_kv_computed_tokens``): the ratio
        of their increments since the last scrape, once PREFILL_MIN_TOKENS new tokens were
        computed, smoothed (half old, half new); the cumulative ratio on the first scrape. Also
        the prefill load: prefill seconds per wall second over windows of at least
        PREFILL_LOAD_WINDOW_S, smoothed the same way. Engines that do not export both sums
        (SGLang) have neither."""
        now = time.monotonic()
        for eid, r in _scraped_ranks(scrapes):
            if r.prefill_seconds is None or r.prefill_tokens is None:
                for d in (self._prefill_costs, self._prefill_loads, self._prefill_sums, self._load_base):
                    d.pop(eid, None)
                continue
            prev = self._prefill_sums.get(eid)
            if prev is None or r.prefill_tokens < prev[1] or r.prefill_seconds < prev[0]:
                # first sight, or the engine restarted (counters went back): start over
                self._prefill_sums[eid] = (r.prefill_seconds, r.prefill_tokens)
                self._load_base[eid] = (r.prefill_seconds, now)
                self._prefill_costs.pop(eid, None)
                self._prefill_loads.pop(eid, None)
                if r.prefill_tokens >= PREFILL_MIN_TOKENS:
                    self._prefill_costs[eid] = r.prefill_seconds / r.prefill_tokens
                continue
            # load: prefill seconds per wall second over at least PREFILL_LOAD_WINDOW_S (the
            # sums move only when requests finish, so short intervals are mostly noise)
            base = self._load_base[eid]
            if now - base[1] >= PREFILL_LOAD_WINDOW_S:
                load = (r.prefill_seconds - base[0]) / (now - base[1])
                old = self._prefill_loads.get(eid)
                self._prefill_loads[eid] = load if old is None else 0.5 * old + 0.5 * load
                self._load_base[eid] = (r.prefill_seconds, now)
            ds, dt = r.prefill_seconds - prev[0], r.prefill_tokens - prev[1]
            if dt < PREFILL_MIN_TOKENS:
                continue  # too little new work to measure: keep the sums and the last estimate
            self._prefill_sums[eid] = (r.prefill_seconds, r.prefill_tokens)
            new = ds / dt
            old = self._prefill_costs.get(eid)
            self._prefill_costs[eid] = new if old is None else 0.5 * old + 0.5 * new

    @property
    def prefill_load_pending(self) -> bool:
        """True while an engine exports prefill time (vLLM) but its first load window
        (PREFILL_LOAD_WINDOW_S) has not closed: the snapshot says "not measured" until then."""
        return any(eid not in self._prefill_loads for eid in self._load_base)

    async def atick(self, client: httpx.AsyncClient | None = None) -> TickResult:
        t0 = time.monotonic()
        self.ticks += 1
        was = self.lease.is_leader
        if not await self.lease.hold():
            res = TickResult(leader=False, reason="standby", seconds=time.monotonic() - t0)
            self.last = res
            return res
        if not was:
            self._new_term()
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
        sem = asyncio.Semaphore(self.concurrency)
        scrapes = list(await asyncio.gather(*(self._scrape(client, sem, ep) for ep in endpoints)))
        res.scrapes = scrapes
        self.scrape_errors += sum(1 for s in scrapes if s.error)
        for s in scrapes:
            if s.error:
                log.info("engine %s: scrape failed: %s", s.endpoint.url, s.error)
        self._update_hit_rates(scrapes)
        self._update_prefill_costs(scrapes)
        res.states = engine_states(self._bridge(scrapes), hit_rates=self._hit_rates, known_ids=self._known_ids,
                                   prefill_costs=self._prefill_costs, prefill_loads=self._prefill_loads)
        if not any(st.healthy for st in res.states):
            # still written: the healthy set is now empty (the epoch bumps, and again when
            # engines come back, restarted with empty caches), and clients read a snapshot
            # without a healthy engine as not fresh (degraded)
            res.reason = "no_healthy_engine" if endpoints else "no_engines"
        return True

    def _bridge(self, scrapes: Sequence[ScrapeResult]) -> list[ScrapeResult]:
        """The scrapes the snapshot is built from: a failed scrape of an engine the router still
        lists as healthy is replaced by that engine's last usable one until it has failed
        ``unhealthy_after`` times in a row. A single timeout must not change the healthy set:
        that bumps the epoch, which ends every ownership window of every session, and the
        engine's recovery a tick later bumps it again. The router's own verdict (unhealthy,
        draining) and an engine never scraped successfully count at once."""
        seen = {s.endpoint.url for s in scrapes}
        for url in [u for u in self._last_good if u not in seen]:  # left the engine list:
            del self._last_good[url]                                # its numbers are no one's now
            self._failed_in_a_row.pop(url, None)
        out = []
        for s in scrapes:
            url = s.endpoint.url
            if s.metrics is not None:
                self._last_good[url] = s.metrics
                self._failed_in_a_row[url] = 0
                out.append(s)
                continue
            n = self._failed_in_a_row.get(url, 0) + 1
            self._failed_in_a_row[url] = n
            last = self._last_good.get(url)
            if s.endpoint.healthy and last is not None and n < self.unhealthy_after:
                self.scrapes_bridged += 1
                out.append(ScrapeResult(s.endpoint, metrics=last, seconds=s.seconds))
                continue
            self._last_good.pop(url, None)  # unhealthy now: only a fresh scrape brings it back
            out.append(s)
        return out

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
        scale = await self._measure_budget(res)
        try:
            res.snapshot = await self.calls.call(self.gate.write_snapshot, res.states, scale)
            res.wrote = True
            self.writes += 1
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

    # -- the budget ---------------------------------------------------------------------------
    def _budget_redis(self) -> dict:
        """The gate's counters the budget controller reads, in one round trip (call thread)."""
        k = lambda n: keys.key(self.name, n)  # noqa: E731
        p = self.redis.pipeline(transaction=False)
        p.hmget(k("ledger"), "acc_ts", "acc_wait_ms", "acc_idle_ms", "n_released", "tok_fresh",
                "tok_reusable", "epoch")
        p.zcard(k("lease_exp"))
        p.hlen(k("windows"))
        p.hget(k("snapshot"), "budget_scale")
        (acc_ts, wait, idle, released, fresh, reusable, epoch), leases, windows, published = p.execute()
        return {"acc_ts": acc_ts, "wait": wait, "idle": idle, "released": released, "fresh": fresh,
                "reusable": reusable, "epoch": epoch, "held": leases + windows, "published": published}

    async def _measure_budget(self, res: TickResult) -> float | None:
        """The budget scale to publish with this tick's snapshot, or None (the config fixes
        it, no ledger, or nothing could be read: the last one stands until it is stale)."""
        if not self.measures_budget:
            return None
        try:
            raw = await self.calls.call(self._budget_redis)
        except Exception as e:  # noqa: BLE001 - Redis faults: the snapshot write reports them
            log.debug("budget read failed: %s", e)
            return None
        num = lambda v: float(v) if v is not None else 0.0  # noqa: E731
        epoch = int(num(raw["epoch"]))
        if self.budget is None:
            # a new term continues from the scale the gate publishes (a dead leader changes
            # nothing but freshness)
            published = num(raw["published"])
            self.budget = BudgetController(published if published > 0 else 1.0)
            self._budget_epoch = epoch
        elif epoch != self._budget_epoch:
            self.budget.reset()  # another engine set: what was learned was about the old one
            self._budget_epoch = epoch
        if raw["acc_ts"] is None:
            return self.budget.scale  # no script ran yet
        queries, hits = _cache_counters(res)
        if queries is False:
            return self.budget.scale  # a scrape failed this tick: its counters are not comparable
        reading = Reading(now_ms=num(raw["acc_ts"]), wait_ms=num(raw["wait"]), idle_ms=num(raw["idle"]),
                          released=int(num(raw["released"])), tok_fresh=int(num(raw["fresh"])),
                          tok_reusable=int(num(raw["reusable"])), held=int(raw["held"]),
                          engine_queries=queries, engine_hits=hits)
        before = self.budget.last
        scale = self.budget.update(reading)
        w = self.budget.last
        if w is not None and w is not before and w.scale_after != w.scale_before:
            log.info("budget scale %.2f -> %.2f (%s: idle %s, retained %s)", w.scale_before, w.scale_after,
                     w.why, _pct(w.idle_share), _pct(w.retained))
        return scale

    def _housekeep_redis(self) -> Any:
        return self.gate.housekeep(limit=self.housekeep_limit)

    async def _housekeep(self, res: TickResult) -> None:
        try:
            res.housekeep = await self.calls.call(self._housekeep_redis)
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
                    except Exception:  # noqa: BLE001 - the loop survives anything a tick throws
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
