"""The self-sizing budget (SPEC 4b): how far the sessions the gate holds may over-commit the
engines' KV pool, measured while the gate runs. Pure code, no I/O: the poller's leader feeds
it one reading per tick and writes the scale it answers into the snapshot
(docs/budget.md has the law, its signals, time constants and why it settles).

The scripts admit against ``capacity x headroom x scale``; scale 1 is the seeds' ledger, which
charges every held session's whole context and so keeps the working set inside the pool. The
controller moves the scale between 1 and as far up as the engines keep paying for it:

* **Grow while the engines idle with turns waiting.** The scripts integrate, exactly, how long
  turns waited in the FIFO and how much of that time no turn of the gate was in flight. Idle
  engines with turns waiting are throughput lost for certain; a re-prefill caused by admitting
  more sessions is at worst paid from that idle time. Over a window the scale grows by the
  share of the window's time lost that way: ``scale x (1 + idle / window)``.
* **Back off when over-committing keeps less history than the ledger did.** With the engines
  busy, admitting more sessions pays only while the cache keeps their histories: the retained
  share of the reusable history (``1 - re-prefilled / reusable`` tokens, from the engines'
  prefix-cache counters against what the gate admitted) times the scale is the history the
  engines serve per unit of the seeds' ledger. When it falls below what scale 1 served (its
  retained share, remembered from the windows run at scale 1), thrashing costs more than the
  extra sessions bring: the scale backs off multiplicatively, towards 1, and from then on grows
  no further than part-way back to where it thrashed (BBR v2's ``inflight_hi``: a bound learned
  from loss, here from lost history).

A window closes once the sessions the gate held at its start have turned over once (as many
releases as held sessions, at least ``MIN_RELEASES``): the controller's time constant is the
workload's own turn cycle, not a number of seconds. No reading, counters that went back (an
engine or Redis restarted), or engines without prefix-cache counters: the scale does not grow,
and it falls back to 1 (the seeds' ledger) where it cannot measure thrash.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Reading", "Window", "BudgetController", "MIN_RELEASES", "IDLE_FLOOR", "BACKOFF", "NOISE", "EWMA"]

#: a window needs at least this many turns released to say anything about the cache
MIN_RELEASES = 8
#: idle shares (of a window's time) below this do not grow the scale: jitter, not spare engines
IDLE_FLOOR = 0.02
#: the multiplicative back-off when over-committing thrashes (as TCP's and BBR's 0.7)
BACKOFF = 0.7
#: retained history within this fraction of what scale 1 served counts as no worse (the
#: window-to-window spread of the retained share)
NOISE = 0.1
#: the weight of a new window in the remembered retained share of scale 1
EWMA = 0.3


@dataclass(frozen=True)
class Reading:
    """One reading of the gate's counters (cumulative, as the scripts and engines keep them)
    and of what it holds now."""

    now_ms: float           # the scripts' clock at the reading (acc_ts: the last script call)
    wait_ms: float          # time turns waited in the FIFO (acc_wait_ms)
    idle_ms: float          # of that, time with no turn of the gate in flight (acc_idle_ms)
    released: int           # leases ended (n_released)
    tok_fresh: int          # admitted prompt tokens new to the engines
    tok_reusable: int       # admitted prompt tokens a session's window held from its last turn
    held: int               # sessions the gate holds now: leases in flight + windows
    engine_queries: float | None = None  # prompt tokens the engines looked up (sum over engines)
    engine_hits: float | None = None     # of those, found in their prefix caches


@dataclass(frozen=True)
class Window:
    """What one closed window measured, and what the controller did with it."""

    idle_share: float | None    # idle time with turns waiting / the window's time (None: no time passed)
    retained: float | None      # 1 - re-prefilled / reusable tokens (None: not measurable)
    scale_before: float
    scale_after: float
    why: str                    # "grow" | "backoff" | "hold" | "no cache counters"


class BudgetController:
    """Feed it :meth:`update` once per poller tick; it answers the scale to publish."""

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = max(1.0, scale) if math.isfinite(scale) else 1.0
        self._start: Reading | None = None
        # the retained share at scale 1 (None: not measured yet, counted as 1: keep everything)
        self.ledger_retained: float | None = None
        # the most the scale may grow to: part-way back to the last scale that thrashed
        self.limit = math.inf
        self.last: Window | None = None

    def reset(self) -> None:
        """Start over from the seeds' ledger (a new engine set: what was learned is of others)."""
        self.__init__()

    def update(self, r: Reading | None) -> float:
        if r is None:
            return self.scale
        s = self._start
        if s is None or _went_back(s, r):
            self._start = r
            return self.scale
        if r.released - s.released < max(MIN_RELEASES, s.held):
            return self.scale
        self._start = r
        self.last = self._close(s, r)
        self.scale = self.last.scale_after
        return self.scale

    def _close(self, s: Reading, r: Reading) -> Window:
        span = r.now_ms - s.now_ms
        idle = (r.idle_ms - s.idle_ms) / span if span > 0 else None
        before = self.scale
        if None in (s.engine_queries, s.engine_hits, r.engine_queries, r.engine_hits):
            # the engines do not say what their caches kept: never over-commit blind
            return Window(idle, None, before, 1.0, "no cache counters")
        retained = _retained(s, r)
        if retained is not None and before <= 1.0:
            old = self.ledger_retained
            self.ledger_retained = retained if old is None else old + EWMA * (retained - old)
        if idle is not None and idle >= IDLE_FLOOR:
            # work lost for certain comes first: a re-prefill is at worst paid from idle time
            if before < self.limit:
                return Window(idle, retained, before, min(self.limit, before * (1.0 + idle)), "grow")
            return Window(idle, retained, before, before, "hold")
        ledger = self.ledger_retained if self.ledger_retained is not None else 1.0
        # history served per unit of the seeds' ledger, against what the ledger served
        if retained is not None and before > 1.0 and before * retained < (1.0 - NOISE) * ledger:
            self.limit = max(1.0, before * math.sqrt(BACKOFF))
            return Window(idle, retained, before, max(1.0, before * BACKOFF), "backoff")
        return Window(idle, retained, before, before, "hold")


def _went_back(s: Reading, r: Reading) -> bool:
    """A counter that decreased: Redis or an engine restarted; the window starts over."""
    if r.wait_ms < s.wait_ms or r.idle_ms < s.idle_ms or r.released < s.released:
        return True
    if r.tok_fresh < s.tok_fresh or r.tok_reusable < s.tok_reusable:
        return True
    for a, b in ((s.engine_queries, r.engine_queries), (s.engine_hits, r.engine_hits)):
        if a is not None and b is not None and b < a:
            return True
    return False


def _retained(s: Reading, r: Reading) -> float | None:
    """The share of the reusable history the engines still held: what they prefilled beyond
    the fresh tokens was re-prefill. None when no session came back to its window."""
    reusable = r.tok_reusable - s.tok_reusable
    if reusable <= 0:
        return None
    uncached = (r.engine_queries - s.engine_queries) - (r.engine_hits - s.engine_hits)
    reprefilled = max(0.0, uncached - (r.tok_fresh - s.tok_fresh))
    return max(0.0, 1.0 - reprefilled / reusable)
