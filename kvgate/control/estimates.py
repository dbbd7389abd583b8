"""What the leader poller makes of its scrapes: per-engine estimates, and the engine states it writes.

``EngineEstimates.states(scrapes)`` is one tick's step from ``ScrapeResult``s
(kvgate/control/scrape.py) to the ``EngineState`` list the snapshot is written from:

* the interval prefix-cache hit rate from vLLM's cumulative counters;
* the prefill cost (seconds per uncached prompt token) and the prefill load (prefill seconds
  per wall second) from vLLM's prefill histogram sums;
* bridging: a failed scrape of an engine the router still calls healthy is replaced by that
  engine's last usable one until it has failed ``unhealthy_after`` times in a row;
* ``engine_states``: one state per engine, or per data-parallel rank.

Engine ids are a URL, or ``<url>#dp<rank>`` for a data-parallel rank; the last usable scrape
and the failures in a row are kept per URL.  All of it belongs to one leader term
(:meth:`EngineEstimates.forget`).  docs/poller.md#one-tick and docs/poller.md#metrics-parsing-decisions say
why each rule is what it is.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Sequence

from kvgate.client.snapshot import EngineState
from kvgate.control.promparse import EngineMetrics
from kvgate.control.scrape import ScrapeResult

# the poller's logger, not this module's: all a poller says is filed under that one name (as
# kvgate/cli.py's own lines about it are), for operators to filter and set levels by
log = logging.getLogger("kvgate.control.poller")

__all__ = ["EngineEstimates", "engine_states", "PREFILL_MIN_TOKENS", "PREFILL_LOAD_WINDOW_S"]

# an interval with fewer newly computed prompt tokens than this does not update the estimate
PREFILL_MIN_TOKENS = 256
# the prefill load is measured over windows of at least this many seconds
PREFILL_LOAD_WINDOW_S = 2.0


def engine_states(scrapes: Sequence[ScrapeResult], *, hit_rates: dict[str, float] | None = None,
                  known_ids: dict[str, list[str]] | None = None,
                  prefill_costs: dict[str, float] | None = None,
                  prefill_loads: dict[str, float] | None = None) -> list[EngineState]:
    """``EngineState`` list from scrape results.

    One state per data-parallel rank; a single-rank engine's id is its base URL, a DP rank's id
    is ``<url>#dp<rank>``.  A failed or unhealthy endpoint yields ``healthy=False`` states for
    the ids it had last time (so the healthy set visibly changes), or for its URL.
    """
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


class EngineEstimates:
    """The leader's per-engine numbers across its ticks, and the engine states built from them.

    ``scrapes_bridged`` counts, over the poller's life, the failed scrapes whose engine kept
    its last usable numbers."""

    def __init__(self, unhealthy_after: int) -> None:
        self.unhealthy_after = unhealthy_after
        self.scrapes_bridged = 0
        self._known_ids: dict[str, list[str]] = {}  # engine URL -> the engine ids it had last
        self._counters: dict[str, tuple[float, float]] = {}  # engine id -> (hits, queries)
        self._hit_rates: dict[str, float] = {}
        self._prefill_sums: dict[str, tuple[float, float]] = {}  # engine id -> (seconds, tokens)
        self._load_base: dict[str, tuple[float, float]] = {}  # engine id -> (seconds, at)
        self._prefill_loads: dict[str, float] = {}  # engine id -> prefill seconds per wall second
        self._prefill_costs: dict[str, float] = {}  # engine id -> smoothed s per uncached token
        self._last_good: dict[str, EngineMetrics] = {}  # engine URL -> its last usable scrape
        self._failed_in_a_row: dict[str, int] = {}  # engine URL -> consecutive failed scrapes

    def forget(self) -> None:
        """Forget every engine's numbers: the poller just became leader, and what it measured
        before (its last term, maybe an hour ago) is not fresh.  A failed scrape is then not
        bridged with an old usage, and rates (prefill load, hit rate, prefill cost) start over
        instead of averaging across the time it stood by."""
        for d in (self._known_ids, self._counters, self._hit_rates, self._prefill_sums, self._load_base,
                  self._prefill_loads, self._prefill_costs, self._last_good, self._failed_in_a_row):
            d.clear()

    def states(self, scrapes: Sequence[ScrapeResult]) -> list[EngineState]:
        """This tick's engine states: the rates move with the fresh scrapes, then failed
        scrapes are bridged and every engine (rank) becomes one state."""
        self._update_hit_rates(scrapes)
        self._update_prefill_costs(scrapes)
        return engine_states(self._bridge(scrapes), hit_rates=self._hit_rates, known_ids=self._known_ids,
                             prefill_costs=self._prefill_costs, prefill_loads=self._prefill_loads)

    @property
    def load_pending(self) -> bool:
        """True while an engine exports prefill time (vLLM) but its first load window
        (PREFILL_LOAD_WINDOW_S) has not closed: the snapshot says "not measured" until then."""
        return any(eid not in self._prefill_loads for eid in self._load_base)

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
