"""``kvgate bench --matrix``: every scenario with no gate, the cap sweep and kvgate, in one table.

One row per scenario: kvgate's wall-clock, no gate's, the best fixed cap (its N and wall),
kvgate's ratio to the better of the two (the target every scenario is judged on), and the
hit rate and re-prefilled tokens of each. With rounds, walls are medians and the ratio is
the median of the per-round ratios.
"""
from __future__ import annotations

from typing import Any, Sequence

from .outcome import Outcome, outcome_record
from .policies import FULL_GATE, NOSHARE_GATE
from .summary import better_baseline, paired_ratio
from .table import fmt_num, fmt_tok

__all__ = ["matrix_row", "render_matrix", "matrix_document"]


def matrix_row(o: Outcome) -> dict:
    """The matrix's row of one scenario's outcome (None where a policy did not run)."""
    rows = {x["policy"]: x for x in o.summary["policies"]}
    gate, none, noshare = rows.get(FULL_GATE), rows.get("none"), rows.get(NOSHARE_GATE)
    cap = rows.get(o.summary.get("best_cap") or "")
    base = better_baseline(o.summary)
    within = next((ok for name, ok, _ in o.verdicts if name.startswith(f"{FULL_GATE} within ")), None)

    def pick(row: dict | None, key: str) -> Any:
        return row.get(key) if row is not None else None

    return {"scenario": o.plan.name, "kvgate_wall_s": pick(gate, "wall_s"), "none_wall_s": pick(none, "wall_s"),
            "best_cap": pick(cap, "cap"), "best_cap_wall_s": pick(cap, "wall_s"),
            "better": pick(base, "policy"),
            "kvgate_vs_better": paired_ratio(gate, base) if gate is not None and base is not None else None,
            "within_target": within,
            "hit_rate": {k: pick(r, "hit_rate") for k, r in (("kvgate", gate), ("none", none), ("best_cap", cap))},
            "reprefill_tokens": {k: pick(r, "reprefill_tokens")
                                 for k, r in (("kvgate", gate), ("none", none), ("best_cap", cap))},
            "caps": o.plan.sweep.caps, "modified": bool(o.changed),
            # where the scenario shares prefixes: against the same gate told nothing of them (bench.json only)
            **({"kvgate_vs_noshare": paired_ratio(gate, noshare)} if gate is not None and noshare is not None else {})}


def render_matrix(rows: Sequence[dict], console: Any, rounds: int) -> None:
    from rich.table import Table

    title = "kvgate bench --matrix" + (f": medians of {rounds} rounds" if rounds > 1 else "")
    t = Table(title=title, header_style="bold")
    for col in ("scenario", "kvgate s", "none s", "best cap", "cap s", "kvgate / better", "target",
                "hit kvgate", "hit none", "hit cap", "re-prefill kvgate", "re-prefill none", "re-prefill cap",
                "caps run"):
        t.add_column(col, justify="left" if col in ("scenario", "target", "caps run") else "right",
                     no_wrap=col == "scenario")
    for r in rows:
        target = {None: "[yellow]NOT MADE[/]", True: "[green]PASS[/]", False: "[red]FAIL[/]"}[r["within_target"]]
        ratio = "-" if r["kvgate_vs_better"] is None else f"{r['kvgate_vs_better']:.3f}x {r['better']}"
        hit, rep = r["hit_rate"], r["reprefill_tokens"]
        t.add_row(r["scenario"] + (" (modified)" if r["modified"] else ""), fmt_num(r["kvgate_wall_s"]),
                  fmt_num(r["none_wall_s"]), "-" if r["best_cap"] is None else f"cap-{r['best_cap']}",
                  fmt_num(r["best_cap_wall_s"]), ratio, target,
                  fmt_num(hit["kvgate"], "{:.3f}"), fmt_num(hit["none"], "{:.3f}"), fmt_num(hit["best_cap"], "{:.3f}"),
                  fmt_tok(rep["kvgate"]), fmt_tok(rep["none"]), fmt_tok(rep["best_cap"]),
                  ",".join(map(str, r["caps"])) or "-")
    console.print(t)
    console.print("better = the faster of no gate and the best fixed cap; target: kvgate at most 1.05x of it; "
                  "re-prefill = uncached prompt tokens beyond those no cache could have served (docs/benchmarks.md).")


def matrix_document(outcomes: Sequence[Outcome], rows: Sequence[dict], context: dict) -> dict:
    """bench.json of a matrix run: the table's rows, and per scenario its whole summary and
    record (checks, cap sweep, changes, warnings), beside the run's context (host, version)."""
    return {"mode": "matrix", "table": list(rows),
            "scenarios": [{**outcome_record(o), **o.summary} for o in outcomes], **context}
