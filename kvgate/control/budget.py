"""The self-sizing budget (SPEC 4b): how much KV the sessions the gate holds may reserve,
as a scale of the seeds' ledger, measured while the gate runs. Pure code, no I/O: the poller's
leader feeds it one reading per tick and writes the scale it answers into the snapshot
(docs/budget.md has the law, its signals, time constants and why it settles).

The scripts admit against ``capacity x headroom x scale`` and revoke windows past
``capacity x scale``; scale 1 is the seeds' ledger. Two things are measured per window, both
in engine time:

* **idle**: the share of the window's time the engines had no turn of the gate in flight
  while turns waited in the FIFO (the scripts integrate it exactly). It is work lost for
  certain: while it exceeds the waste below, the scale grows to carry the work that time
  could have done, ``scale / (1 - idle)`` (at most doubling per window; doubling outright in
  startup, from the ledger with nothing measured, until three windows in a row do not grow,
  or one backs off); past the pool, no further than the re-prefill of the over-commit costs
  what the idle time could have done.
* **waste**: the share of the engines' time spent re-prefilling histories they had already
  computed: the re-prefilled tokens (their prefix-cache counters against the fresh tokens the
  gate admitted) times the cost of a prefilled token, the least their prefill time per
  prefilled token has been in any window of this term (as BBR takes the least round trip: the
  engines' own counters also count time a request queued or shared its batch, which only ever
  adds). A waste of half the engines' time or more, above the idle share, means the held
  sessions thrash: the scale backs off, ``scale x 0.7`` (never below the ledger, scale 1), and
  from then on grows no further than part-way back to where it thrashed (BBR v2's
  ``inflight_hi``: a bound learned from loss, here from lost work), until the engines have
  idled at that bound, losing no work, as long as the thrash cost them: then the bound steps
  back up (BBR v2 raises ``inflight_hi`` when a probe finds no loss), so a thrash that recurs
  at any scale (a burst of young sessions each rollout step) does not ratchet the scale down
  for good.

A window closes once the sessions the gate held at its start have turned over once (as many
releases as held sessions, at least ``MIN_RELEASES``): the controller's time constant is the
workload's own turn cycle, not a number of seconds. Missing signals fail safe: without the
engines' prefix-cache counters the scale is 1 (never over-commit blind); without their prefill
time the back-off falls back to comparing retained history with what the ledger kept.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Reading", "Window", "BudgetController", "MIN_RELEASES", "IDLE_FLOOR", "MAX_GROWTH", "STARTUP_FLAT",
           "BACKOFF", "THRASH", "MIN_PREFILL_TOKENS", "NOISE", "EWMA"]

#: a window needs at least this many turns released to say anything about the cache
MIN_RELEASES = 8
#: idle shares (of a window's time) below this do not grow the scale: jitter, not spare engines
IDLE_FLOOR = 0.02
#: the most one window grows the scale: doubling, as TCP's slow start per round trip
MAX_GROWTH = 2.0
#: startup ends after this many windows in a row that did not grow (BBR's full-pipe test: three
#: rounds without growth), or at once on a back-off
STARTUP_FLAT = 3
#: the multiplicative back-off when the held sessions thrash (as TCP's and BBR's 0.7)
BACKOFF = 0.7
#: the share of the engines' time re-prefilling at which the held sessions thrash: more of it
#: than of everything else they do
THRASH = 0.5
#: a window must have prefilled this many tokens to measure what one costs
MIN_PREFILL_TOKENS = 256
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
    engine_prefill_s: float | None = None  # seconds the engines spent prefilling (sum over engines)
    engine_queue_s: float | None = None  # seconds requests queued inside the engines (sum over engines)
    engines: int = 1                     # how many engines (ranks) those sums are over
    capacity_tokens: float | None = None  # the engines' KV capacity in tokens (sum over engines)


@dataclass(frozen=True)
class Window:
    """What one closed window measured, and what the controller did with it."""

    idle_share: float | None    # idle time with turns waiting / the window's time (None: no time passed)
    retained: float | None      # 1 - re-prefilled / reusable tokens (None: not measurable)
    waste: float | None         # re-prefill seconds / the engines' time (None: no prefill time)
    scale_before: float
    scale_after: float
    why: str                    # "grow" | "backoff" | "relax" (bound stepped up) | "hold" | "no cache counters"
    queue: float | None = None  # requests queued inside the engines, on average per engine


class BudgetController:
    """Feed it :meth:`update` once per poller tick; it answers the scale to publish."""

    def __init__(self, scale: float = 1.0, startup: bool = False) -> None:
        # never below the ledger (a scale an older poller published below it starts there)
        self.scale = max(1.0, scale) if math.isfinite(scale) else 1.0
        # starting from the ledger with nothing measured, growth takes rule 1's largest step
        # (doubling) until STARTUP_FLAT windows in a row do not grow, or one backs off (TCP's
        # slow start, BBR's startup and its full-pipe test). Not the first window that does not
        # grow: a cold start admits a burst of first turns that keeps the engines busy through
        # the first window whatever the budget, so that window's missing idle time says nothing
        # about the room the engines have (flat: the windows in a row that did not grow)
        self.startup = startup
        self.flat = 0
        self._start: Reading | None = None
        # the retained share at scale 1 (None: not measured yet, counted as 1: keep everything)
        self.ledger_retained: float | None = None
        # the most the scale may grow to: part-way back to the last scale that thrashed, a step
        # higher each time the engines have idled at it, losing no work, as long as that
        # thrash cost them (debt: its re-prefill share of a window; paid: the idle shares since)
        self.limit = math.inf
        self.debt = self.paid = 0.0
        # seconds of prefill per prefilled token: the least any window of this term measured
        self.token_cost: float | None = None
        self.last: Window | None = None

    def reset(self) -> None:
        """Start over from the seeds' ledger (a new engine set: what was learned is of others),
        in startup."""
        self.__init__(startup=True)

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
        self.flat = 0 if self.last.why == "grow" else self.flat + 1
        if self.flat >= STARTUP_FLAT or self.last.why == "backoff":
            self.startup = False
        return self.scale

    def _close(self, s: Reading, r: Reading) -> Window:
        span = r.now_ms - s.now_ms
        idle = (r.idle_ms - s.idle_ms) / span if span > 0 else None
        before = self.scale
        if None in (s.engine_queries, s.engine_hits, r.engine_queries, r.engine_hits):
            # the engines do not say what their caches kept: never over-commit blind
            return Window(idle, None, None, before, 1.0, "no cache counters")
        retained = _retained(s, r)
        waste = self._waste(s, r, span)
        queue = _queue(s, r, span)
        window = lambda after, why: Window(idle, retained, waste, before, after, why, queue)  # noqa: E731
        if retained is not None and before == 1.0:
            old = self.ledger_retained
            self.ledger_retained = retained if old is None else old + EWMA * (retained - old)
        known_waste = waste if waste is not None else 0.0
        if waste is not None:
            lost_work = waste >= THRASH
        else:
            # no prefill time: history served per unit of the seeds' ledger, against what the
            # ledger served
            ledger = self.ledger_retained if self.ledger_retained is not None else 1.0
            lost_work = retained is not None and before > 1.0 and before * retained < (1.0 - NOISE) * ledger
        if idle is not None and idle >= IDLE_FLOOR and idle > known_waste:
            # the engines lost more time idling with turns waiting than re-prefilling: used,
            # that idle time would carry 1 / (1 - idle) times the work (at most double it)
            over = self._overcommit_bound(idle * span / 1000.0, r)
            bound = min(self.limit, over)
            if before < bound:
                gain = MAX_GROWTH if self.startup else 1.0 / max(1.0 / MAX_GROWTH, 1.0 - idle)
                return window(min(bound, before * gain), "grow")
            if self.limit <= over and not lost_work:
                # the bound learned from a thrash holds the scale while the engines idle, and
                # nothing thrashes at it: what thrashed then (a burst of young sessions, another
                # load) may not now. Once the idle time paid at the bound adds up to what that
                # thrash cost, the bound steps back up by what one back-off took off it (ski
                # rental: hold until holding has cost what the probe may; BBR v2 raises
                # inflight_hi when a probe finds no loss). Without this every later
                # thrash would lower it for good, down to the ledger over a long run.
                self.paid += idle
                if self.paid >= self.debt:
                    self.limit = self.limit / math.sqrt(BACKOFF)
                    self.paid = 0.0
                    return window(before, "relax")
            return window(before, "hold")
        thrash = lost_work and (waste is None or waste > (idle or 0.0))
        if thrash and before > 1.0:
            # never below the ledger: what the scale adds above it is the over-commit, which a
            # back-off to 1 takes away whole. Below it the gate would hold fewer sessions than
            # the pool fits, and the trim would revoke windows whose owners come back to a cold
            # re-prefill: the next windows' re-prefill, which no lower scale removes
            # (docs/budget.md#never-below-the-ledger)
            after = max(1.0, before * BACKOFF)
            self.limit = max(after, before * math.sqrt(BACKOFF))
            # what the thrash cost, in windows of the engines' time: the bound's price
            self.debt, self.paid = (waste if waste is not None else THRASH), 0.0
            return window(after, "backoff")
        return window(before, "hold")

    def _overcommit_bound(self, idle_s: float, r: Reading) -> float:
        """The most the scale may over-commit the pool: tokens past the pool are the history the
        engines' LRU evicts, re-prefilled once a turnover at least (more where it evicts what
        comes back next), so the over-commit may cost no more re-prefill than the window's idle
        time could have done. Unbounded while the token cost or the pool is unknown."""
        if self.token_cost is None or not r.capacity_tokens:
            return math.inf
        return 1.0 + idle_s * max(1, r.engines) / (self.token_cost * r.capacity_tokens)

    def _waste(self, s: Reading, r: Reading, span_ms: float) -> float | None:
        """The share of the engines' time spent re-prefilling (None without prefill time)."""
        if None in (s.engine_prefill_s, r.engine_prefill_s) or span_ms <= 0:
            return None
        uncached, reprefilled = _prefilled(s, r)
        if uncached >= MIN_PREFILL_TOKENS:
            cost = (r.engine_prefill_s - s.engine_prefill_s) / uncached
            if cost > 0 and (self.token_cost is None or cost < self.token_cost):
                self.token_cost = cost
        if self.token_cost is None:
            return None
        return self.token_cost * reprefilled / (span_ms / 1000.0 * max(1, r.engines))


def _queue(s: Reading, r: Reading, span_ms: float) -> float | None:
    """How many requests queued inside the engines over the window, on average per engine
    (None when an engine does not export its queue time)."""
    if None in (s.engine_queue_s, r.engine_queue_s) or span_ms <= 0:
        return None
    return (r.engine_queue_s - s.engine_queue_s) / (span_ms / 1000.0 * max(1, r.engines))


def _went_back(s: Reading, r: Reading) -> bool:
    """A counter that decreased: Redis or an engine restarted; the window starts over."""
    if r.wait_ms < s.wait_ms or r.idle_ms < s.idle_ms or r.released < s.released:
        return True
    if r.tok_fresh < s.tok_fresh or r.tok_reusable < s.tok_reusable:
        return True
    for a, b in ((s.engine_queries, r.engine_queries), (s.engine_hits, r.engine_hits),
                 (s.engine_prefill_s, r.engine_prefill_s), (s.engine_queue_s, r.engine_queue_s)):
        if a is not None and b is not None and b < a:
            return True
    return False


def _retained(s: Reading, r: Reading) -> float | None:
    """The share of the reusable history the engines still held: what they prefilled beyond
    the fresh tokens was re-prefill. None when no session came back to its window."""
    reusable = r.tok_reusable - s.tok_reusable
    if reusable <= 0:
        return None
    return max(0.0, 1.0 - _prefilled(s, r)[1] / reusable)


def _prefilled(s: Reading, r: Reading) -> tuple[float, float]:
    """What the engines prefilled over the window (lookups - hits), and of it the re-prefill:
    the part beyond the fresh tokens the gate admitted."""
    uncached = (r.engine_queries - s.engine_queries) - (r.engine_hits - s.engine_hits)
    return uncached, max(0.0, uncached - (r.tok_fresh - s.tok_fresh))
