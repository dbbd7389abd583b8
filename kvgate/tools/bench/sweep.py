"""The fixed-cap sweep the gate is measured against, and how it widens itself.

The sweep starts at one, one and a half and two times the sessions whose final contexts fit
in the pool. The best cap is often at its edge (cap-4 of {2, 3, 4} on cpu-tiny, where no
gate was faster still), and a best cap at the edge of a sweep is not the best fixed cap: so
after the caps have run, while the best one (by median wall-clock over the rounds run) is
the largest cap tried, a larger one is added, and while it is the smallest, a smaller one,
up to :data:`MAX_ADDED_CAPS`. A cap of every session or more is no gate (which runs anyway),
so the sweep never reaches it. ``--caps`` fixes the sweep: no widening.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from .workload import Workload

__all__ = ["default_caps", "parse_caps", "cap_to_add", "cap_walls", "CapSweep", "MAX_ADDED_CAPS", "WIDEN_FACTOR"]

#: at most this many caps are added to a sweep: each is one more policy per round (on the
#: CPU scenarios ~40 s each), and a best cap still at the edge after six steps of x1.5 is
#: eleven times the first one, far outside any regime the sweep was derived for
MAX_ADDED_CAPS = 6
#: each added cap is the edge cap times (or divided by) this, rounded, and at least one apart
WIDEN_FACTOR = 1.5


def default_caps(workload: Workload, pool_tokens: int | None) -> list[int]:
    """One, one and a half (rounded half up) and two times the number of sessions whose final
    contexts fit in the pool ("fit"), below the number of sessions and deduplicated; where the
    pool is unknown, a quarter of the sessions stands in for fit. Empty when every session
    fits: a cap of every session is no gate.

    The best cap often lies between fit and twice fit (cap-20 of a 12..36 sweep on the
    default scenario, cap-3 on cpu-heavy), so the sweep has a point there; where it lies
    outside, the sweep widens (:func:`cap_to_add`). ``--caps`` sweeps anything."""
    n = len(workload.sessions)
    if pool_tokens:
        mean_final = workload.working_set_tokens() / max(1, n)
        fit = max(1, int(pool_tokens / max(1.0, mean_final)))
    else:
        fit = max(1, n // 4)
    return sorted({c for c in (fit, (3 * fit + 1) // 2, 2 * fit) if c < n})


def parse_caps(text: str) -> list[int]:
    """``--caps 2,3,4`` -> [2, 3, 4] (ValueError for anything but integers >= 1)."""
    try:
        caps = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--caps expects integers separated by commas, got {text!r}") from None
    if not caps or any(c < 1 for c in caps):
        raise ValueError(f"--caps needs integers >= 1, got {text!r}")
    return sorted(set(caps))


def _half_up(x: float) -> int:
    return int(x + 0.5)


def cap_to_add(walls: Mapping[int, float | None], sessions: int) -> int | None:
    """The cap to run next so that the best cap lies inside the sweep, or None.

    ``walls``: every cap tried and its median wall-clock (None for a cap whose turns failed:
    it cannot be the best). When the best is the largest cap tried, a larger one: x1.5
    rounded, at least one more, at most ``sessions - 1`` (a cap of every session is no gate);
    when it is the smallest (above 1), a smaller one: /1.5 rounded, at least one less.
    A tie on wall-clock goes to the smaller cap."""
    timed = {c: w for c, w in walls.items() if w is not None}
    if not timed:
        return None
    best = min(timed, key=lambda c: (timed[c], c))
    tried = sorted(walls)
    if best == tried[-1]:
        up = min(sessions - 1, max(best + 1, _half_up(best * WIDEN_FACTOR)))
        if up > best and up not in walls:
            return up
    if best == tried[0] and best > 1:
        down = max(1, min(best - 1, _half_up(best / WIDEN_FACTOR)))
        if down not in walls:
            return down
    return None


def cap_walls(rounds: Iterable[Iterable]) -> dict[int, float | None]:
    """Each fixed cap's median wall-clock over the rounds given (lists of PolicyResults);
    None for a cap with failed turns in any round."""
    by: dict[int, list[float | None]] = {}
    for results in rounds:
        for r in results:
            if r.policy.kind == "cap":
                by.setdefault(r.policy.cap, []).append(None if r.errors else r.wall_s)
    return {c: None if any(w is None for w in ws) else statistics.median(ws) for c, ws in by.items()}


@dataclass
class CapSweep:
    """The caps of one run: the initial sweep, those widening added, and why it stopped."""

    initial: list[int]
    sessions: int
    widen: bool  # False with --caps, or when no `cap` sweep is in the policies
    added: list[int] = field(default_factory=list)
    stopped_by_bound: bool = False

    def next_cap(self, walls: Mapping[int, float | None]) -> int | None:
        """The cap to add after a sweep with these walls (recorded as added), or None."""
        if not self.widen:
            return None
        cap = cap_to_add(walls, self.sessions)
        if cap is None:
            return None
        if len(self.added) >= MAX_ADDED_CAPS:
            self.stopped_by_bound = True
            return None
        self.added.append(cap)
        return cap

    @property
    def caps(self) -> list[int]:
        return sorted(set(self.initial) | set(self.added))

    def note(self, best_cap: int | None) -> str:
        """One line on how the sweep ended, for the console ("" where there is nothing to say)."""
        if not self.widen:
            return ""
        caps = ", ".join(map(str, self.caps)) or "none"
        if not self.caps:
            return (f"cap sweep: every cap it derives holds all {self.sessions} sessions at once, which is no "
                    f"gate: none run")
        added = f"; widened by {', '.join(map(str, self.added))}" if self.added else ""
        if self.stopped_by_bound:
            return (f"cap sweep {caps}{added}: stopped at its bound of {MAX_ADDED_CAPS} added caps with the best "
                    f"(cap-{best_cap}) still at its edge")
        if best_cap is not None and best_cap == self.caps[-1] and best_cap == self.sessions - 1:
            return f"cap sweep {caps}{added}: the best, cap-{best_cap}, is one below the sessions (the next is no gate)"
        if best_cap is not None and best_cap == self.caps[0] == 1:
            return f"cap sweep {caps}{added}: the best is cap-1"
        return f"cap sweep {caps}{added}: the best is inside the sweep"

    def describe(self) -> dict:
        return {"initial": list(self.initial), "added": list(self.added), "caps": self.caps,
                "sessions": self.sessions, "widen": self.widen, "stopped_by_bound": self.stopped_by_bound,
                "max_added": MAX_ADDED_CAPS}
