"""The fixed-cap sweep: where it starts, when it widens, where it stops, and how the added caps
take their place in the rounds. Synthetic results, no timings."""
from __future__ import annotations

import asyncio
import contextlib

import pytest

from kvgate.tools.bench import rounds as rounds_mod
from kvgate.tools.bench.engines import Counters
from kvgate.tools.bench.flags import build_parser
from kvgate.tools.bench.policies import Policy, parse_policies
from kvgate.tools.bench.preflight import Plan
from kvgate.tools.bench.runner import PolicyResult
from kvgate.tools.bench.scenarios import SCENARIOS
from kvgate.tools.bench.sweep import MAX_ADDED_CAPS, CapSweep, cap_to_add, cap_walls
from kvgate.tools.bench.workload import IntRange, WorkloadSpec, generate


@pytest.mark.parametrize("walls, sessions, want", [
    ({2: 9.0, 3: 8.0, 4: 7.0}, 12, 6),     # best at the top: x1.5
    ({2: 9.0, 3: 8.0, 4: 7.0}, 6, 5),      # ... but below the sessions: a cap of 6 is no gate
    ({2: 9.0, 3: 8.0, 4: 7.0}, 5, None),   # 4 is one below 5 sessions: nothing larger to try
    ({12: 7.0, 18: 8.0, 24: 9.0}, 40, 8),  # best at the bottom: /1.5
    ({2: 7.0, 3: 8.0}, 12, 1),             # /1.5 of 2 rounds to 1
    ({1: 7.0, 2: 8.0}, 12, None),          # cap-1 best: nothing smaller
    ({2: 9.0, 3: 7.0, 4: 8.0}, 12, None),  # inside: done
    ({3: 7.0}, 12, 5),                     # one cap, both edges: up first (x1.5 of 3 = 4.5, half up)
    ({1: 7.0}, 12, 2),                     # x1.5 of 1 is 1.5: at least one more
    ({2: 8.0, 3: 8.0, 4: 9.0}, 12, 1),     # a tie goes to the smaller cap: 2 is the bottom edge
    ({2: 9.0, 3: 8.0, 4: None}, 12, None),  # 4 failed: the best (3) is inside what ran
    ({2: None, 3: None}, 12, None),        # nothing timed
])
def test_a_cap_is_added_where_the_best_is_at_the_edge(walls, sessions, want):
    assert cap_to_add(walls, sessions) == want


def test_the_sweep_widens_until_the_best_is_inside_and_stops_at_its_bound():
    def wall(c: int, best: int) -> float:  # a valley with its floor at `best`
        return 10.0 + abs(c - best)

    def widen(best: int, sessions: int, initial=(2, 3, 4)) -> CapSweep:
        sweep = CapSweep(list(initial), sessions, widen=True)
        while (c := sweep.next_cap({c: wall(c, best) for c in sweep.caps})) is not None:
            assert c not in sweep.initial and 1 <= c < sessions
        return sweep

    s = widen(7, 40)
    assert s.added == [6, 9] and s.caps == [2, 3, 4, 6, 9] and not s.stopped_by_bound
    assert "the best is inside the sweep" in s.note(6)
    s = widen(1, 40, initial=(12, 18, 24))
    assert s.added == [8, 5, 3, 2, 1] and not s.stopped_by_bound
    assert "the best is cap-1" in s.note(1)
    s = widen(39, 40)  # up to one below the sessions, then it has nowhere to go
    assert s.caps[-1] == 39 and not s.stopped_by_bound and "the next is no gate" in s.note(39)
    s = widen(1000, 10_000)
    assert len(s.added) == MAX_ADDED_CAPS and s.stopped_by_bound
    assert s.added == [6, 9, 14, 21, 32, 48]
    assert f"stopped at its bound of {MAX_ADDED_CAPS} added caps" in s.note(48)
    assert s.describe()["stopped_by_bound"] is True and s.describe()["caps"] == s.caps
    fixed = CapSweep([2, 3, 4], 40, widen=False)  # --caps: as given
    assert fixed.next_cap({2: 9.0, 3: 8.0, 4: 7.0}) is None and fixed.added == [] and fixed.note(4) == ""
    assert "none run" in CapSweep([], 6, widen=True).note(None)


def _workload(sessions: int = 20):
    return generate(WorkloadSpec(sessions=sessions, turns=IntRange(2, 2), first_prompt=IntRange(10, 10),
                                 tool_result=IntRange(5, 5), output=IntRange(5, 5)), seed=0)


class _Env:
    """Engines that are never called: the stand-in step below reads only the policy."""

    block_size = 16

    @contextlib.asynccontextmanager
    async def fresh(self):
        yield None

    def describe(self) -> dict:
        return {}


def _result(policy: Policy, wall: float) -> PolicyResult:
    return PolicyResult(policy=policy, wall_s=wall, turns=[], counters=Counters(50, 100), samples=[],
                        usage_samples=[])


def _rounds(monkeypatch, initial, n_rounds, wall):
    """Run the real rounds loop with a stand-in step whose wall-clock is ``wall(policy, round)``;
    return (the order the policies ran in, the rounds, the plan)."""
    wl = _workload()
    sweep = CapSweep(list(initial), len(wl.sessions), widen=True)
    plan = Plan(name="default", scenario=SCENARIOS["default"], time_scale=1.0, snapshot_interval_s=0.1,
                workload=wl, env=_Env(), pool=None, policies=parse_policies("none,cap,kvgate", sweep.caps),
                sweep=sweep, base_cfg=None)
    ran: list[str] = []

    async def step(policy, workload, client, **kw):
        ran.append(policy.name)
        rnd = sum(1 for name in ran if name == policy.name)
        return _result(policy, wall(policy, rnd))

    monkeypatch.setattr(rounds_mod, "run_policy", step)
    args = build_parser().parse_args(["--rounds", str(n_rounds), "--no-progress"])
    rounds = asyncio.run(rounds_mod.run_rounds(plan, args, None, None))
    return ran, rounds, plan


def test_caps_added_in_round_one_run_in_every_later_round_interleaved(monkeypatch):
    def wall(p: Policy, rnd: int) -> float:
        return 10.0 + abs(p.cap - 7) if p.kind == "cap" else 15.0

    ran, rounds, plan = _rounds(monkeypatch, [2, 3, 4], 3, wall)
    order = ["none", "cap-2", "cap-3", "cap-4", "cap-6", "cap-9", "kvgate"]
    # round 1 in the plan's order, then the caps the sweep added; rounds 2 and 3 the widened list
    assert ran == ["none", "cap-2", "cap-3", "cap-4", "kvgate", "cap-6", "cap-9"] + order + order
    assert [p.name for p in plan.policies] == order
    assert all([r.policy.name for r in results] == order for results in rounds)
    assert plan.sweep.added == [6, 9] and cap_walls(rounds)[6] == 11.0


def test_a_cap_added_on_the_medians_runs_once_per_round(monkeypatch):
    # round 1 puts the best inside {2, 3, 4}; rounds 2 and 3 move it to the top edge, so only
    # the medians over all three rounds ask for a larger cap: it then runs once for each round
    def wall(p: Policy, rnd: int) -> float:
        if p.kind != "cap":
            return 15.0
        return 10.0 + abs(p.cap - 3) if rnd == 1 else 10.0 + abs(p.cap - 5)

    ran, rounds, plan = _rounds(monkeypatch, [2, 3, 4], 3, wall)
    base = ["none", "cap-2", "cap-3", "cap-4", "kvgate"]
    assert ran == base * 3 + ["cap-6", "cap-6", "cap-6"]
    assert plan.sweep.added == [6]  # medians: cap-4 11.0, cap-6 11.0 (round 1: 13) -> the tie goes to 4
    assert all([r.policy.name for r in results] == ["none", "cap-2", "cap-3", "cap-4", "cap-6", "kvgate"]
               for results in rounds)
    assert [r.wall_s for results in rounds for r in results if r.policy.name == "cap-6"] == [13.0, 11.0, 11.0]


def test_one_round_widens_inside_it_and_nothing_more(monkeypatch):
    ran, rounds, plan = _rounds(monkeypatch, [12, 18], 1,
                                lambda p, rnd: 10.0 + p.cap if p.kind == "cap" else 50.0)
    assert len(rounds) == 1 and plan.sweep.added == [8, 5, 3, 2, 1]
    assert ran == ["none", "cap-12", "cap-18", "kvgate", "cap-8", "cap-5", "cap-3", "cap-2", "cap-1"]
    assert [r.policy.name for r in rounds[0]] == ["none", "cap-1", "cap-2", "cap-3", "cap-5", "cap-8", "cap-12",
                                                  "cap-18", "kvgate"]
