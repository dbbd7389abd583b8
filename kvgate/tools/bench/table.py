"""The terminal table of one scenario's run, and the lines under it."""
from __future__ import annotations

from typing import Any, Sequence

from .summary import straggler

__all__ = ["render_table", "fmt_num", "fmt_tok"]


def _counts_text(items: Any) -> str:
    """``admit/open 5, admit/aged 2``: (name, count) pairs as the report prints them, in the
    given order; empty for none."""
    return ", ".join(f"{k} {n}" for k, n in items)


def fmt_num(x: Any, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def fmt_tok(x: float | None) -> str:
    if x is None:
        return "-"
    if x >= 1e6:
        return f"{x / 1e6:.2f}M"
    if x >= 1e3:
        return f"{x / 1e3:.0f}k"
    return f"{x:.0f}"


def render_table(summary: dict, console: Any = None, scenario: str = "") -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console()
    wl = summary["workload"]
    title = (f"kvgate bench{(' — ' + scenario) if scenario else ''}: {wl['sessions']} sessions, "
             f"{wl['turns']} turns, working set {fmt_tok(wl['working_set_tokens'])} tokens")
    t = Table(title=title, header_style="bold")
    for col, just in (("policy", "left"), ("wall s", "right"), ("x none", "right"), ("hit rate", "right"),
                      ("uncached", "right"), ("re-prefill", "right"), ("p50 s", "right"), ("p99 s", "right"),
                      ("late p50 s", "right"), ("waits", "right"), ("preempt", "right"),
                      ("eng. preempt", "right"), ("admissions by reason", "left")):
        if col == "policy":  # names like kvgate[max_wait_s=600] must stay whole
            width = max([len(x["policy"]) + 2 for x in summary["policies"]] + [6])
            t.add_column(col, justify=just, no_wrap=True, min_width=width)
        else:
            t.add_column(col, justify=just)
    for x in summary["policies"]:
        name = escape(x["policy"]) + (" *" if x["best_cap"] else "")  # [..] is rich markup otherwise
        if x["errors"]:
            name += f" ({x['errors']} err)"
        adm = _counts_text(x["admissions"].items()) or "-"
        t.add_row(name, fmt_num(x["wall_s"]), fmt_num(x["ratio_to_none"]), fmt_num(x["hit_rate"], "{:.3f}"),
                  fmt_tok(x["uncached_tokens"]), fmt_tok(x["reprefill_tokens"]),
                  fmt_num(x["latency_p50_s"], "{:.3f}"),
                  fmt_num(x["latency_p99_s"], "{:.3f}"), fmt_num(x["late_latency_p50_s"], "{:.3f}"),
                  str(x["waits"]), fmt_num(x["gate_preemptions"], "{:.0f}"),
                  fmt_num(x.get("engine_preemptions"), "{:.0f}"), adm)
    console.print(t)
    block = summary.get("block_size")
    unavoidable = (f"first prompts, tool results, and each turn's history past its last whole block of {block} "
                   "tokens (engines reuse whole blocks only)" if block else
                   "first prompts and tool results (block size unknown: partial blocks count as re-prefill)")
    console.print("* best fixed cap. 'late' = turns in the last third of their session; "
                  f"{escape(_hit_source_text(summary['policies']))}; re-prefill = uncached prompt "
                  f"tokens beyond those no cache could have served: {unavoidable}; preempt = attempts the "
                  "gate preempted, eng. preempt = the engines' own preemptions (vLLM) or retractions (SGLang).")
    for x in summary["policies"]:
        by = x.get("reprefill_by_admission")
        if x["kind"] == "gate" and by:
            parts = ", ".join(f"{escape(k)} {fmt_tok(v['reprefill_tokens'])} ({v['turns']} turns)"
                              for k, v in by.items())
            console.print(f"re-prefill by admission, {escape(x['policy'])}: {parts}")
    for x in summary["policies"]:
        rounds = x.get("rounds")
        if rounds and x["policy"] != "none":
            ratios = "" if all(r["ratio_to_none"] is None for r in rounds) else \
                "x none " + ", ".join(fmt_num(r["ratio_to_none"]) for r in rounds) + "; "
            console.print(f"rounds, {escape(x['policy'])}: {ratios}wall "
                          + ", ".join(fmt_num(r["wall_s"]) for r in rounds) + " s (the table: medians)")
    for x in summary["policies"]:
        last = straggler(x)
        if last:
            # how its turns got in: under a gate, more than one `admit/open` (or any `admit/aged`)
            # means the session lost its window on the way and waited for a place again
            adm = _counts_text(sorted((last.get("admissions") or {}).items(), key=lambda kv: (-kv[1], kv[0])))
            how = f"; admitted {adm}" if adm else ""
            console.print(f"step ended by {escape(last['session'])} ({escape(x['policy'])}) at {last['end_s']:.2f} s: "
                          f"first turn ready at {last['first_ready_s']:.2f} s, then {last['turns_done']} turns: "
                          f"{'slot' if x.get('kind') in ('cap', 'turncap') else 'gate'} waits "
                          f"{last['waited_s']:.2f} s, engine {last['engine_s']:.2f} s, "
                          f"tools and the rest {last['other_s']:.2f} s{escape(how)}")
    for x in summary["policies"]:
        iw = x.get("idle_while_waiting")
        if x["kind"] == "gate" and iw:
            console.print(f"engines idle while turns waited, {escape(x['policy'])}: {iw['share']:.0%} of the "
                          f"{iw['samples']} samples with turns waiting (of {iw['of']}; how to read it: "
                          "docs/knobs.md)")


_HIT_SOURCES = {"engine /metrics": "from the engines' own /metrics counters",
                "responses (cached_tokens)": "from the responses' cached_tokens (the engines' counters could "
                                             "not be read)",
                "unavailable": "unavailable (no counters, no cached_tokens)"}


def _hit_source_text(rows: Sequence[dict]) -> str:
    """Where the table's hit rates come from: one source for all policies, or each source with
    the policies it served (in the table's order)."""
    by: dict[str, list[str]] = {}
    for x in rows:
        by.setdefault(x.get("hit_rate_source") or "unavailable", []).append(x["policy"])
    if len(by) <= 1:
        return "hit rate " + _HIT_SOURCES.get(next(iter(by), "engine /metrics"), next(iter(by), ""))
    return "hit rate: " + "; ".join(f"{', '.join(names)} {_HIT_SOURCES.get(src, src)}" for src, names in by.items())
