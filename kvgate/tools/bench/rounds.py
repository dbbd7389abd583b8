"""Running one scenario's plan: every policy once per round, rounds one after another, and
the caps the sweep adds while its best cap is at its edge.

Round 1 runs each policy once, in order; the sweep then widens on round 1's wall-clocks,
each added cap running in round 1 at once, so rounds 2..N run the widened list interleaved
like every other policy. After the last round the sweep is judged again on the medians over
all rounds; a cap added then runs once for each round, one after another (it cannot be
interleaved with rounds that are over), and its result joins that round.
"""
from __future__ import annotations

import argparse
from typing import Any

from .policies import Policy
from .preflight import Plan
from .runner import PolicyResult, run_policy
from .sweep import cap_walls

__all__ = ["run_rounds", "insert_cap"]


def insert_cap(policies: list[Policy], new: Policy) -> list[Policy]:
    """``policies`` with the fixed cap ``new`` among the others, in cap order (after the
    other policies when there are no caps)."""
    at = next((i for i, p in enumerate(policies) if p.kind == "cap" and p.cap > new.cap), None)
    if at is None:
        caps = [i for i, p in enumerate(policies) if p.kind == "cap"]
        at = caps[-1] + 1 if caps else len(policies)
    return policies[:at] + [new] + policies[at:]


async def run_rounds(plan: Plan, args: argparse.Namespace, redis_url: str | None,
                     console: Any) -> list[list[PolicyResult]]:
    """Every policy of ``plan`` ``args.rounds`` times, interleaved, with the cap sweep widened
    as the module says; updates ``plan.policies`` to what ran."""
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    n_rounds = args.rounds
    steps = getattr(args, "steps", 1)
    total = plan.workload.num_turns * n_rounds * steps
    progress = Progress(TextColumn("{task.description:<14}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("turns"), TimeElapsedColumn(), TextColumn("{task.fields[info]}"),
                        console=console, disable=args.no_progress, transient=False)
    tasks: dict[str, Any] = {}
    walls: dict[str, list[str]] = {}

    def track(p: Policy) -> None:
        tasks[p.name] = progress.add_task(escape(p.name), total=total, info="", start=False)
        walls[p.name] = []

    async def one(p: Policy) -> PolicyResult:
        tid = tasks[p.name]
        progress.start_task(tid)
        async with plan.env.fresh() as client:
            res = await run_policy(p, plan.workload, client, time_scale=plan.time_scale, redis_url=redis_url,
                                   base_cfg=plan.base_cfg, scale_knobs=not args.no_scale_knobs,
                                   snapshot_interval_s=plan.snapshot_interval_s,
                                   on_turn=lambda rec: progress.advance(tid),
                                   step_timeout_s=getattr(args, "step_timeout", None), steps=steps)
        hr = res.counters.hit_rate
        walls[p.name].append("/".join(f"{w:.2f}" for w in res.step_walls) + "s")
        progress.update(tid, info=" ".join(walls[p.name]) + (f"  hit {hr:.3f}" if hr is not None else ""))
        progress.stop_task(tid)
        return res

    def add(cap: int) -> Policy:
        added = Policy(f"cap-{cap}", "cap", cap=cap)
        plan.policies = insert_cap(plan.policies, added)
        track(added)
        return added

    def in_order(results: list[PolicyResult]) -> list[PolicyResult]:
        rank = {p.name: i for i, p in enumerate(plan.policies)}
        return sorted(results, key=lambda r: rank[r.policy.name])

    rounds: list[list[PolicyResult]] = []
    with progress:
        for p in plan.policies:
            track(p)
        for i in range(n_rounds):
            results = [await one(p) for p in plan.policies]
            if i == 0:  # widen on round 1, inside it: later rounds interleave the added caps
                while (cap := plan.sweep.next_cap(cap_walls([results]))) is not None:
                    results.append(await one(add(cap)))
            rounds.append(in_order(results))
        # judged again on the medians of all rounds: an added cap runs once per round now
        while n_rounds > 1 and (cap := plan.sweep.next_cap(cap_walls(rounds))) is not None:
            added = add(cap)
            for results in rounds:
                results.append(await one(added))
            rounds[:] = [in_order(r) for r in rounds]
    return rounds
