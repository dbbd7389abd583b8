"""What one scenario's run comes to: its summary over the rounds, the targets it met or
missed, what its flags changed in the scenario, and the warnings about its numbers. The
single-scenario report and the matrix both print and record it the same way."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from .checks import checks, round_lag_warnings
from .flags import scenario_changes
from .preflight import Plan
from .runner import PolicyResult
from .summary import combine_rounds, summarize
from .sweep import default_caps

__all__ = ["Outcome", "evaluate", "print_verdicts", "outcome_record"]


@dataclass
class Outcome:
    plan: Plan
    rounds: list[list[PolicyResult]]
    summaries: list[dict]  # one per round
    summary: dict  # combined over the rounds (the medians)
    verdicts: list[tuple[str, bool | None, str]]
    changed: list[str]  # what the flags changed in the named scenario ([] where nothing)
    warnings: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def sweep_note(self) -> str:
        best = self.summary.get("best_cap")
        rows = {x["policy"]: x for x in self.summary["policies"]}
        return self.plan.sweep.note(rows[best]["cap"] if best else None)

    @property
    def errors(self) -> int:
        return sum(r.errors for results in self.rounds for r in results)

    @property
    def first_error(self) -> str:
        return next((e for results in self.rounds for r in results for e in r.error_examples), "")


def evaluate(plan: Plan, rounds: list[list[PolicyResult]], args: argparse.Namespace,
             elapsed_s: float = 0.0) -> Outcome:
    """Summarize ``rounds`` of ``plan`` and judge them."""
    # the engines' block size, where the bench knows it (the simulator's profile; a real
    # engine's when its env records one): re-prefill then leaves out the partial blocks
    block = getattr(plan.env, "block_size", None)
    summaries = [summarize(results, plan.workload, block_size=block) for results in rounds]
    summary = combine_rounds(summaries)
    sweep = plan.sweep
    # the scenario-specific targets are about its own sessions on the simulator: a trace's
    # sessions are not the scenario's, and real engines are another machine
    verdicts = checks(summary, None if args.trace else plan.name, simulator=not args.engine,
                      caps_are_no_gate=sweep.widen and not sweep.caps)
    caps_run = [p.cap for p in plan.policies if p.kind == "cap"]
    # the sweep the scenario's own rule chose is the scenario; --caps or cap-N is a change
    chosen = sweep.caps if sweep.widen else default_caps(plan.workload, plan.pool)
    changed = scenario_changes(args, plan.scenario, time_scale=plan.time_scale, caps_run=caps_run,
                               default_caps=chosen) if any(ok is not None for _, ok, _ in verdicts) else []
    return Outcome(plan=plan, rounds=rounds, summaries=summaries, summary=summary, verdicts=verdicts,
                   changed=changed, warnings=round_lag_warnings(summaries, plan.time_scale), elapsed_s=elapsed_s)


def print_verdicts(o: Outcome, console: Any, prefix: str = "") -> None:
    """The sweep's note, the PASS / FAIL / NOT MADE lines and the warnings of ``o``, each
    line starting with ``prefix`` (the scenario's name in the matrix)."""
    from rich.markup import escape

    pre = escape(prefix)
    if o.sweep_note:
        console.print(f"{pre}{escape(o.sweep_note)}", highlight=False)
    if o.changed:
        console.print(f"{pre}[yellow]modified scenario[/] ({escape(', '.join(o.changed))}): the checks below are "
                      f"made on it, but the targets are defined on the unmodified {escape(o.plan.name)} scenario",
                      highlight=False)
    for name, ok, detail in o.verdicts:
        mark = "[yellow]NOT MADE[/]" if ok is None else "[green]PASS[/]" if ok else "[red]FAIL[/]"
        note = " [yellow](modified scenario)[/]" if o.changed and ok is not None else ""
        console.print(f"{pre}{mark} {escape(name)}: {escape(detail)}{note}", highlight=False)  # kvgate[..] is markup
    for line in o.warnings:
        console.print(f"{pre}[yellow]warning:[/] {escape(line)}", highlight=False)


def outcome_record(o: Outcome) -> dict:
    """The JSON fields of ``o`` beside its summary."""
    return {"scenario": o.plan.name, "time_scale": o.plan.time_scale,
            "engines": o.plan.env.describe() if o.plan.env is not None else {},
            "elapsed_s": o.elapsed_s, "caps": o.plan.sweep.caps, "cap_sweep": o.plan.sweep.describe(),
            "checks": [{"check": n, "passed": ok, "detail": d, "made": ok is not None,
                        "modified_scenario": bool(o.changed)} for n, ok, d in o.verdicts],
            "scenario_modified_by": o.changed, "warnings": o.warnings}
