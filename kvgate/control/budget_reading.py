"""The leader poller's budget reading: what it feeds kvgate/control/budget.py each tick.

Each tick the leader reads the gate's counters (the ledger's integrals and totals, the leases
and windows it holds, the scale it publishes: one pipelined Redis read) and sums the engines'
prefix-cache counters over this tick's scrapes; together they are one ``budget.Reading`` for
the ``BudgetController``, whose scale the tick writes with its snapshot.  The controller
belongs to one leader term and starts from the scale the gate publishes (a dead leader
changes nothing but freshness); a new epoch (another set of engines) resets it.  A gate whose
config fixes ``budget_scale`` or has admission off measures nothing.  docs/budget.md has the
law itself.
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

from kvgate import keys
from kvgate.control.budget import BudgetController, Reading
from kvgate.control.call_threads import CallThreads
from kvgate.control.scrape import ScrapeResult

# the poller's logger, not this module's: all a poller says is filed under that one name (as
# kvgate/cli.py's own lines about it are), for operators to filter and set levels by
log = logging.getLogger("kvgate.control.poller")

__all__ = ["BudgetReader", "engine_counters"]


def engine_counters(scrapes: Sequence[ScrapeResult]) -> dict | None:
    """The engines' counters the controller reads, summed over this tick's scrapes: prefix-
    cache lookups and hits, prefill seconds and queue seconds (each None when an engine does
    not export it), the number of engines (ranks) and their KV capacity
    in tokens (what the snapshot's ledger capacity sums). None when a
    healthy engine's scrape failed: its last numbers are older than the others'."""
    ranks = []
    for s in scrapes:
        if s.metrics is None:
            if s.endpoint.healthy:
                return None
            continue
        ranks.extend(s.metrics.ranks)

    def total(name: str, pair: str | None = None) -> float | None:
        # a sum over every engine, or None when one does not export it (or its pair)
        if any(getattr(r, n) is None for r in ranks for n in (name, pair or name)):
            return None
        return sum((getattr(r, name) for r in ranks), 0.0)

    # lookups and hits are read as a pair: one without the other says nothing
    return {"queries": total("prefix_cache_queries", "prefix_cache_hits"),
            "hits": total("prefix_cache_hits", "prefix_cache_queries"),
            "prefill_s": total("prefill_seconds"), "queue_s": total("queue_seconds"),
            "engines": len(ranks), "capacity": total("capacity_tokens")}


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


class BudgetReader:
    """One poller's budget readings; ``controller`` is None until the first reading of a term."""

    def __init__(self, redis_client: Any, gate_name: str, config: Any, calls: CallThreads) -> None:
        self.redis = redis_client
        self.gate_name = gate_name
        self.calls = calls
        # the self-sizing budget (docs/budget.md) is measured unless the gate's config fixes
        # the scale or has no ledger (admission off)
        self.measures = bool(config.admission) and config.budget_scale is None
        self.controller: BudgetController | None = None
        self._epoch: int | None = None

    def new_term(self) -> None:
        """The next reading starts from the scale the gate publishes then."""
        self.controller = None

    def _read_counters(self) -> dict:
        """The gate's counters the budget controller reads, in one round trip (call thread)."""
        k = lambda n: keys.key(self.gate_name, n)  # noqa: E731
        p = self.redis.pipeline(transaction=False)
        p.hmget(k("ledger"), "acc_ts", "acc_wait_ms", "acc_idle_ms", "n_released", "tok_fresh",
                "tok_reusable", "epoch")
        p.zcard(k("lease_exp"))
        p.hlen(k("windows"))
        p.hget(k("snapshot"), "budget_scale")
        (acc_ts, wait, idle, released, fresh, reusable, epoch), leases, windows, published = p.execute()
        return {"acc_ts": acc_ts, "wait": wait, "idle": idle, "released": released, "fresh": fresh,
                "reusable": reusable, "epoch": epoch, "held": leases + windows, "published": published}

    async def measure(self, scrapes: Sequence[ScrapeResult]) -> float | None:
        """The budget scale to publish with this tick's snapshot, or None (the config fixes
        it, no ledger, or nothing could be read: the last one stands until it is stale)."""
        if not self.measures:
            return None
        try:
            raw = await self.calls.call(self._read_counters)
        except Exception as e:  # noqa: BLE001 - Redis faults: the snapshot write reports them
            log.debug("budget read failed: %s", e)
            return None
        num = lambda v: float(v) if v is not None else 0.0  # noqa: E731
        epoch = int(num(raw["epoch"]))
        if self.controller is None:
            # a new term continues from the scale the gate publishes (a dead leader changes
            # nothing but freshness)
            published = num(raw["published"])
            # (from the ledger, with nothing measured: in startup)
            self.controller = (BudgetController(published) if published > 0
                               else BudgetController(startup=True))
            self._epoch = epoch
        elif epoch != self._epoch:
            self.controller.reset()  # another engine set: what was learned was about the old one
            self._epoch = epoch
        if raw["acc_ts"] is None:
            return self.controller.scale  # no script ran yet
        eng = engine_counters(scrapes)
        if eng is None:
            return self.controller.scale  # a scrape failed this tick: its counters are not comparable
        reading = Reading(now_ms=num(raw["acc_ts"]), wait_ms=num(raw["wait"]), idle_ms=num(raw["idle"]),
                          released=int(num(raw["released"])), tok_fresh=int(num(raw["fresh"])),
                          tok_reusable=int(num(raw["reusable"])), held=int(raw["held"]),
                          engine_queries=eng["queries"], engine_hits=eng["hits"],
                          engine_prefill_s=eng["prefill_s"], engine_queue_s=eng["queue_s"],
                          engines=eng["engines"], capacity_tokens=eng["capacity"])
        before = self.controller.last
        scale = self.controller.update(reading)
        w = self.controller.last
        if w is not None and w is not before:
            # every window, moved or not: the law's readings are what an operator checks it by
            bound = f", bound {self.controller.limit:.2f}" if w.why == "relax" else ""
            log.info("budget scale %.2f -> %.2f (%s%s: idle %s, re-prefill %s of the engines' time, "
                     "engine queue %s, retained %s)", w.scale_before, w.scale_after, w.why, bound,
                     _pct(w.idle_share), _pct(w.waste), "-" if w.queue is None else f"{w.queue:.2f}",
                     _pct(w.retained))
        return scale
