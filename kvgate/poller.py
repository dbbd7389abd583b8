"""The poller: discovers engines, scrapes their ``/metrics``, writes capacity snapshots.

One small process per gate (``kvgate poller ...``), or a library object::

    poller = kvgate.poller.Poller(gate, router="http://router:30000")
    poller.run()                      # until poller.stop() / SIGTERM (CLI)

Each tick:

1. leadership: take or extend the leader lease (a ``redis.lock.Lock`` on
   ``kvgate:{gate}:poller_leader`` with ``leader_ttl_s``); a standby stops here;
2. discover engines (router ``/workers`` -> ``/list_workers``, or the static list);
3. scrape every engine's ``/metrics`` concurrently (bounded concurrency, an overall deadline and
   a body-size cap per request);
4. build one ``EngineState`` per engine (per data-parallel rank); an engine the router marks
   unhealthy is ``healthy=False``, and so is one whose scrape failed (no answer, garbage)
   ``unhealthy_after`` times in a row (default 2: until then its last usable scrape stands
   in, so one timeout does not bump the epoch and end every ownership window);
5. if at least one engine is healthy, and the lease is still ours, ``gate.write_snapshot``
   (one atomic script; the core bumps the epoch when the healthy set changes).  When the router
   is unreachable or no engine is healthy, *no* snapshot is written: the last one goes stale
   and clients bypass as ``degraded`` after ``staleness_s`` (fail open);
6. ``gate.housekeep(limit=...)`` (reclaim expired leases and windows, drop dead waiters, wake).

Only the leader writes and housekeeps.  See docs/poller.md.
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
from redis.exceptions import LockError, RedisError

from kvgate._http import async_client
from kvgate.discovery import (
    DEFAULT_MAX_BODY_BYTES,
    Discovery,
    DiscoveryError,
    Endpoint,
    HttpError,
    fetch_limited,
)
from kvgate.promparse import EngineMetrics, MetricsParseError, parse_metrics

log = logging.getLogger("kvgate.poller")

__all__ = ["Poller", "TickResult", "ScrapeResult", "engine_states", "leader_key"]


# an interval with fewer newly computed prompt tokens than this does not update the estimate
PREFILL_MIN_TOKENS = 256
# the prefill load is measured over windows of at least this many seconds
PREFILL_LOAD_WINDOW_S = 2.0


def leader_key(gate_name: str) -> str:
    try:
        from kvgate.keys import key
    except ImportError:  # pragma: no cover - keys.py is the lead's; same format
        return f"kvgate:{{{gate_name}}}:poller_leader"
    return key(gate_name, "poller_leader")


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
    from kvgate.snapshot import EngineState

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


def _redis_of(gate: Any) -> redis.Redis:
    if type(gate).__name__.startswith("Async"):
        raise ValueError("Poller needs a synchronous kvgate.Gate (it runs its own event loop), "
                         f"got {type(gate).__name__}")
    for attr in ("redis", "client", "_redis", "_client", "r"):
        c = getattr(gate, attr, None)
        if isinstance(c, (redis.Redis, redis.RedisCluster)):
            return c
    raise ValueError("cannot find the gate's redis client; pass redis=... to Poller")


def _gate_name(gate: Any) -> str:
    for attr in ("name", "gate", "gate_name"):
        v = getattr(gate, attr, None)
        if isinstance(v, str) and v:
            return v
    raise ValueError("cannot find the gate's name; pass name=... to Poller")


class Poller:
    """Discover + scrape + write snapshots for one gate; leader-elected through Redis."""

    def __init__(
        self,
        gate: Any,
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
        for nm, v in (("interval_s", interval_s), ("http_timeout_s", http_timeout_s),
                      ("leader_ttl_s", leader_ttl_s)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v < float("inf")):
                raise ValueError(f"{nm} must be a positive finite number, got {v!r}")
        if leader_ttl_s <= interval_s:
            raise ValueError(f"leader_ttl_s ({leader_ttl_s}) must exceed interval_s ({interval_s}), "
                             "or the lease lapses between ticks")
        if leader_ttl_s <= 2 * http_timeout_s:
            log.warning("leader_ttl_s (%s) <= 2 x http_timeout_s (%s): a slow router or engine can make "
                        "the lease lapse mid-tick and leadership flap", leader_ttl_s, http_timeout_s)
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
        self.name = name or _gate_name(gate)
        self.redis = redis_client if redis_client is not None else _redis_of(gate)
        self.identity = identity or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.lock = self.redis.lock(leader_key(self.name), timeout=self.leader_ttl_s,
                                    blocking=False, thread_local=False)
        self.is_leader = False
        self.last: TickResult | None = None
        self.ticks = 0
        self.writes = 0
        self.leader_changes = 0
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

    # -- leadership -----------------------------------------------------------------------
    def _hold_lease(self) -> bool:
        """Extend the lease if we hold it, else try to take it.  Redis faults -> not leader."""
        was = self.is_leader
        try:
            got = False
            if getattr(self.lock.local, "token", None) is not None:
                # We held it at some point: extending checks the token atomically, so this also
                # keeps a lease we still own after a Redis blip made us think we lost it.
                try:
                    self.lock.extend(self.leader_ttl_s, replace_ttl=True)
                    got = True
                except LockError:
                    pass  # expired (we stalled) or taken over
            if not got:
                got = bool(self.lock.acquire(blocking=False, token=self.identity))
        except RedisError as e:
            log.warning("leader lease: redis error: %s", e)
            got = False
        self.is_leader = got
        if got != was:
            self.leader_changes += 1
            log.info("poller %s is now %s", self.identity, "LEADER" if got else "standby")
        return got

    def leader_identity(self) -> str | None:
        try:
            v = self.redis.get(leader_key(self.name))
        except RedisError:
            return None
        return v.decode() if isinstance(v, bytes) else v

    def release(self) -> None:
        """Give up the lease at once (graceful shutdown: a standby takes over next tick)."""
        if getattr(self.lock.local, "token", None) is not None:
            try:
                self.lock.release()  # a no-op error if the lease is no longer ours
            except (LockError, RedisError):
                pass
        self.is_leader = False

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
        if not await self._off_loop(self._hold_lease):
            res = TickResult(leader=False, reason="standby", seconds=time.monotonic() - t0)
            self.last = res
            return res
        own = client is None
        if own:
            client = async_client(trust_env=False)
        try:
            res = await self._lead_tick(client)
        finally:
            if own:
                await client.aclose()
        res.seconds = time.monotonic() - t0
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
        if fenced and not await self._off_loop(self._hold_lease):  # discovery may have taken two request deadlines
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
            res.reason = "no_healthy_engine" if endpoints else "no_engines"
            return False
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
                await self._off_loop(self._housekeep, res)
            return res
        # Fence: scraping took time; write only if the lease is still ours.
        if not await self._off_loop(self._hold_lease):
            res.leader = False
            res.reason = "lost_lease"
            return res
        try:
            res.snapshot = await self._off_loop(self.gate.write_snapshot, res.states)
            res.wrote = True
            self.writes += 1
        except Exception as e:  # noqa: BLE001 - Redis down, script errors: never kill the loop
            res.reason = f"write_failed: {type(e).__name__}: {e}"
            log.warning("write_snapshot failed: %s: %s", type(e).__name__, e)
        await self._off_loop(self._housekeep, res)
        return res

    @staticmethod
    async def _off_loop(fn: Any, *args: Any) -> Any:
        """Run one of the tick's Redis calls (synchronous redis-py: the lease, the snapshot
        write, housekeeping) in a worker thread, so a poller embedded in an application's event
        loop (``arun``, the bench) does not stop that loop for a Redis round trip, or for up to
        ``redis_timeout_s`` when Redis stalls. The calls of one tick still run one after another."""
        return await asyncio.to_thread(fn, *args)

    def _housekeep(self, res: TickResult) -> None:
        try:
            res.housekeep = self.gate.housekeep(limit=self.housekeep_limit)
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
                self.release()

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
            "identity": self.identity, "leader": self.is_leader, "ticks": self.ticks,
            "writes": self.writes, "leader_changes": self.leader_changes,
            "scrape_errors": self.scrape_errors, "scrapes_bridged": self.scrapes_bridged,
            "last_reason": last.reason if last else None,
            "last_errors": last.errors if last else {},
        }
