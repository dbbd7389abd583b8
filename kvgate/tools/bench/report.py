"""Summaries, the terminal table, the JSON file and the PNG plots of a bench run."""
from __future__ import annotations

import json
import math
import statistics
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Sequence

from .runner import PolicyResult
from .workload import Workload, parse_range

__all__ = ["summarize", "combine_rounds", "render_table", "write_json", "write_plots", "checks", "lag_warnings",
           "round_lag_warnings", "straggler", "scenario_changes"]


def _pct(xs: Sequence[float], p: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * p
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _is_attempt_preemption(key: str) -> bool:
    """The step metric counting preempted attempts (``<prefix>admission/preempted``), not the
    per-session gauges beside it (``..._sessions``, ``..._max_per_session``)."""
    return key == "admission/preempted" or key.endswith("/admission/preempted")


def _continues(prev: Any, t: Any, resets: Any) -> bool:
    """Whether turn record ``t`` extends the history ``prev`` (the session's previous record)
    left in the engine: no reset in between (the workload's marks) and a prompt at least as long
    as what ``prev`` sent and got back (a shorter one is a reset or truncation)."""
    if any((t.session, i) in resets for i in range(prev.turn + 1, t.turn + 1)):
        return False
    return t.prompt_tokens >= prev.prompt_tokens + prev.output_tokens


def _reusable(prev: Any, t: Any, block: int) -> int:
    """Tokens of ``t``'s prompt a cache that kept everything could have served after ``prev``:
    the whole blocks of ``prev``'s prompt + output but its last token (whose KV is never
    computed; what SGLang's ``cache_finished_req`` and vLLM cache), at most ``input - 1`` tokens
    (both engines always compute the last prompt token)."""
    return min((prev.prompt_tokens + max(prev.output_tokens - 1, 0)) // block,
               (t.prompt_tokens - 1) // block) * block


def _unavoidable_tokens(turns: Sequence[Any], block: int, resets: Any = frozenset()) -> int:
    """Prompt tokens no cache could have served, turn by turn, from the turn records: a first
    turn's (or a reset's) whole prompt; a continuation's prompt minus :func:`_reusable` from the
    session's previous record (the last one that reached the engine, when a turn failed)."""
    n = 0
    for ts in _by_session(turns).values():
        prev = None
        for t in ts:
            if prev is not None and _continues(prev, t, resets):
                n += t.prompt_tokens - _reusable(prev, t, block)
            else:
                n += t.prompt_tokens
            prev = t
    return n


def summarize(results: Sequence[PolicyResult], workload: Workload, block_size: int | None = None) -> dict:
    """One dict per policy plus the comparisons (ratios to ``none``, best cap).

    ``block_size``: the engines' KV block (page) size, when known. Re-prefill is then the
    uncached tokens beyond those a cache that kept everything could not have served, turn by
    turn (:func:`_unavoidable_tokens`: engines reuse whole blocks only); without it, the
    uncached tokens beyond the workload's fresh tokens (first prompts, tool results), which
    also counts each turn's partial last block (``reprefill_tokens_beyond_fresh``, always in
    the row)."""
    fresh = workload.fresh_tokens()
    block = block_size if block_size and block_size > 0 else None
    resets = {(s.session_id, i) for s in workload.sessions for i, t in enumerate(s.turns)
              if t.reset_to is not None}
    n_turns_sess = {s.session_id: len(s.turns) for s in workload.sessions}
    rows = []
    for r in results:
        lat = [t.latency_s for t in r.turns]
        late = [t.latency_s for t in r.turns
                if t.turn >= (2 * n_turns_sess.get(t.session, 1)) // 3]
        by_idx: dict[int, list[float]] = defaultdict(list)
        for t in r.turns:
            by_idx[t.turn].append(t.latency_s)
        client_prompt = sum(t.prompt_tokens for t in r.turns)
        client_cached = [t.cached_tokens for t in r.turns if t.cached_tokens is not None]
        if r.counters.ok and r.counters.queries > 0:
            hit = r.counters.hits / r.counters.queries
            uncached = r.counters.queries - r.counters.hits
            hit_src = "engine /metrics"
        elif client_cached and client_prompt:
            hit = sum(client_cached) / client_prompt
            uncached = client_prompt - sum(client_cached)
            hit_src = "responses (cached_tokens)"
        else:
            hit, uncached, hit_src = None, None, "unavailable"
        reasons = Counter(f"{t.outcome}/{t.reason}" if t.reason else (t.outcome or "-")
                          for t in r.turns if t.outcome or t.reason)
        waits = [t.waited_s for t in r.turns if t.waited_s > 0]
        preempt = sum(v for k, v in r.step_metrics.items()
                      if _is_attempt_preemption(k) and isinstance(v, (int, float)) and not isinstance(v, bool))
        unavoidable = _unavoidable_tokens(r.turns, block, resets) if block else fresh
        rows.append({
            "policy": r.policy.name,
            "kind": r.policy.kind,
            "cap": r.policy.cap,
            "wall_s": r.wall_s,
            "turns_done": len(r.turns),
            "errors": r.errors,
            "error_examples": r.error_examples,
            "hit_rate": hit,
            "hit_rate_source": hit_src,
            "hit_rate_responses": (sum(client_cached) / client_prompt) if client_cached and client_prompt else None,
            "prompt_tokens": client_prompt,
            "uncached_tokens": uncached,
            "reprefill_tokens": max(0.0, uncached - unavoidable) if uncached is not None else None,
            "reprefill_tokens_beyond_fresh": max(0.0, uncached - fresh) if uncached is not None else None,
            "unavoidable_tokens": unavoidable,
            "latency_p50_s": _pct(lat, 0.5),
            "latency_p99_s": _pct(lat, 0.99),
            "late_latency_p50_s": _pct(late, 0.5),
            "latency_by_turn_s": {str(i): sum(v) / len(v) for i, v in sorted(by_idx.items())},
            "admissions": dict(sorted(reasons.items())),
            "waits": len(waits),
            "wait_mean_s": (sum(waits) / len(waits)) if waits else 0.0,
            "gate_preemptions": preempt,
            "engine_preemptions": r.counters.preemptions if r.counters.ok else None,
            "hit_rate_over_time": _hit_series(r.samples),
            "usage_over_time": [(round(t, 3), round(u, 4)) for t, u in r.usage_samples],
            "gate_over_time": r.gate_samples,
            "idle_while_waiting": _idle_while_waiting(r.gate_samples),
            "reprefill_by_admission": _reprefill_by_admission(r.turns, block, resets),
            "sessions": _session_rows(r.turns, n_turns_sess),
            "loop_lag_s": {"p50": _pct(r.loop_lags, 0.5), "p99": _pct(r.loop_lags, 0.99),
                           "max": max(r.loop_lags) if r.loop_lags else None, "n": len(r.loop_lags)},
            "step_metrics": r.step_metrics,
            "gate": r.gate_config,
        })
    base = next((x for x in rows if x["policy"] == "none"), None)
    for x in rows:
        x["ratio_to_none"] = (x["wall_s"] / base["wall_s"]) if base and base["wall_s"] > 0 else None
    caps = [x for x in rows if x["kind"] == "cap" and not x["errors"]]
    best_cap = min(caps, key=lambda x: x["wall_s"]) if caps else None
    for x in rows:
        x["best_cap"] = bool(best_cap is not None and x is best_cap)
    return {"workload": workload.describe(), "policies": rows,
            "best_cap": best_cap["policy"] if best_cap else None, "block_size": block}


def combine_rounds(summaries: Sequence[dict]) -> dict:
    """One summary from ``--rounds`` summaries of the same policies (one per round, each
    policy run once per round, side by side). Each policy's row is its median round (the round
    whose wall-clock is nearest the median: its series, sessions and step metrics), with
    ``wall_s`` and ``hit_rate`` the medians over the rounds, ``ratio_to_none`` the median of the
    per-round ratios (each measured side by side), ``errors`` summed over the rounds, and
    ``rounds`` listing every round's wall-clock, ratio and hit rate. The best cap is the cap
    with the lowest median wall-clock. One summary comes back as it is."""
    if len(summaries) == 1:
        return summaries[0]

    def med(xs: Sequence[float | None]) -> float | None:
        vals = [x for x in xs if x is not None]
        return statistics.median(vals) if vals else None

    rows = []
    for name in [x["policy"] for x in summaries[0]["policies"]]:
        per = [next(x for x in s["policies"] if x["policy"] == name) for s in summaries]
        wall = statistics.median(x["wall_s"] for x in per)
        row = dict(min(per, key=lambda x: abs(x["wall_s"] - wall)))
        row.update(wall_s=wall, hit_rate=med([x["hit_rate"] for x in per]),
                   ratio_to_none=med([x["ratio_to_none"] for x in per]),
                   errors=sum(x["errors"] for x in per),
                   error_examples=[e for x in per for e in x["error_examples"]][:5],
                   rounds=[{"wall_s": x["wall_s"], "ratio_to_none": x["ratio_to_none"], "hit_rate": x["hit_rate"]}
                           for x in per])
        rows.append(row)
    caps = [x for x in rows if x["kind"] == "cap" and not x["errors"]]
    best_cap = min(caps, key=lambda x: x["wall_s"]) if caps else None
    for x in rows:
        x["best_cap"] = bool(best_cap is not None and x is best_cap)
    return {"workload": summaries[0]["workload"], "policies": rows,
            "best_cap": best_cap["policy"] if best_cap else None,
            "block_size": summaries[0].get("block_size")}


def _by_session(turns: Sequence[Any]) -> dict[str, list[Any]]:
    """Each session's turn records, in turn order."""
    by: dict[str, list[Any]] = defaultdict(list)
    for t in turns:
        by[t.session].append(t)
    for ts in by.values():
        ts.sort(key=lambda t: t.turn)
    return by


def _session_rows(turns: Sequence[Any], n_turns: dict[str, int]) -> list[dict]:
    """Per session, ordered by when it finished: turns, when its first turn was ready and
    when it reached the engine, when its last turn ended, and how its time split into gate
    waits, engine time and the rest (tool calls). The last rows are the step's stragglers."""
    out = []
    for sid, ts in _by_session(turns).items():
        first, end = ts[0], max(t.done_s for t in ts)
        waited = sum(t.start_s - t.ready_s for t in ts)
        engine = sum(t.done_s - t.start_s for t in ts)
        out.append({"session": sid, "turns": n_turns.get(sid, len(ts)), "turns_done": len(ts),
                    "first_ready_s": round(first.ready_s, 3), "first_start_s": round(first.start_s, 3),
                    "end_s": round(end, 3), "waited_s": round(waited, 3), "engine_s": round(engine, 3),
                    "other_s": round(end - first.ready_s - waited - engine, 3),
                    "admissions": dict(sorted(Counter(f"{t.outcome}/{t.reason}" for t in ts
                                                      if t.outcome or t.reason).items()))})
    out.sort(key=lambda x: x["end_s"])
    return out


def _counts_text(items: Any) -> str:
    """``admit/open 5, admit/aged 2``: (name, count) pairs as the report prints them, in the
    given order; empty for none."""
    return ", ".join(f"{k} {n}" for k, n in items)


def straggler(policy_row: dict) -> dict | None:
    """The session that finished last (the step's wall-clock ends with it), from a policy row's
    ``sessions`` (ordered by end); None without session rows. Its split says what made the step
    long: gate waits (the gate held the straggler back), engine time, or its own tool calls."""
    rows = policy_row.get("sessions") or []
    return rows[-1] if rows else None


def round_lag_warnings(summaries: Sequence[dict], time_scale: float) -> list[str]:
    """:func:`lag_warnings` for every round of a ``--rounds`` run (prefixed ``round N:`` when
    there are several): the combined summary carries only each policy's median round, and a
    starved round elsewhere distorts the medians too."""
    pre = len(summaries) > 1
    return [(f"round {i}: " if pre else "") + w
            for i, s in enumerate(summaries, 1) for w in lag_warnings(s, time_scale)]


def _reprefill_by_admission(turns: Sequence[Any], block: int | None = None,
                            resets: Any = frozenset()) -> dict[str, dict[str, int]] | None:
    """Which admissions paid for the re-prefill: per admission (``admit/aged``, ``-`` for an
    ungated turn), the turns and the prompt tokens the engine computed although it had seen
    them before. Read from the responses' ``cached_tokens``, turn by turn: a turn's new tokens
    are its prompt minus the previous turn's prompt and output (its whole prompt for a first
    turn or a reset context); whatever else was not cached is re-prefill. With the block size
    known, only what a cache that kept everything could have served counts as seen
    (:func:`_reusable`: whole blocks, at most ``input - 1`` tokens). ``None`` when the engines
    report no ``cached_tokens``."""
    out: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    seen = False
    for ts in _by_session(turns).values():
        prev = None
        for t in ts:
            seen_before = 0
            if prev is not None and t.turn == prev.turn + 1:
                seen_before = prev.prompt_tokens + prev.output_tokens
                if t.prompt_tokens < seen_before or (t.session, t.turn) in resets:
                    seen_before = 0  # reset or truncated context: nothing reusable
                elif block:
                    seen_before = _reusable(prev, t, block)
            prev = t
            if t.cached_tokens is None:
                continue
            seen = True
            key = f"{t.outcome}/{t.reason}" if t.reason else (t.outcome or "-")
            row = out[key]
            row[0] += 1
            row[1] += max(0, seen_before - t.cached_tokens)
    if not seen:
        return None
    return {k: {"turns": n, "reprefill_tokens": tok}
            for k, (n, tok) in sorted(out.items(), key=lambda kv: -kv[1][1])}


def _idle_while_waiting(samples: Sequence[dict]) -> dict | None:
    """Of the gate samples with turns waiting, the share with no turn in flight (no lease):
    how often the gate held turns back while the engines had nothing to do. 0 on the
    simulator's GPU profile, 0.1-0.5 on the CPU vLLM models (docs/knobs.md). None without such
    samples."""
    waiting = [s for s in samples if (s.get("waiting") or 0) > 0 and s.get("leases") is not None]
    if not waiting:
        return None
    idle = sum(1 for s in waiting if s["leases"] == 0)
    return {"share": idle / len(waiting), "samples": len(waiting), "of": len(samples)}


def _hit_series(samples: Sequence[tuple[float, float, float]]) -> list[tuple[float, float | None]]:
    """Windowed hit rate between consecutive samples (None when nothing was prefilled)."""
    out = []
    ph = pq = 0.0
    for t, h, q in samples:
        dq = q - pq
        out.append((round(t, 3), round((h - ph) / dq, 4) if dq > 0 else None))
        ph, pq = h, q
    return out


def checks(summary: dict, scenario: str) -> list[tuple[str, bool | None, str]]:
    """The issue-5 acceptance checks that apply to ``scenario`` (name, passed, detail), for
    every full-gate policy of the run (``kvgate`` and each ``kvgate[k=v,...]``).

    ``scenario``: ``pressure`` (default, long-context), ``no-pressure``, ``cpu-heavy`` (within
    10 % of the best fixed cap) or ``cpu-tiny`` (no more than 10 % slower than no gate).

    ``passed`` is None for a check that was not made because the policy it compares against
    did not run (no ``none``, no fixed cap; or no full-gate policy at all): its detail starts
    with ``not made:`` and says why. Whether the run's scenario was the issue's is the caller's
    to say (:func:`scenario_changes`)."""
    rows = {x["policy"]: x for x in summary["policies"]}
    none = rows.get("none")
    bc = rows.get(summary.get("best_cap") or "")
    no_none = "not made: the no-gate policy ('none') did not run"
    no_cap = "not made: no fixed-cap policy ran (cap or cap-N in --policies)"
    out: list[tuple[str, bool | None, str]] = []
    gates = [x for x in summary["policies"] if x["policy"] == "kvgate" or x["policy"].startswith("kvgate[")]
    if not gates:
        return [("kvgate (no checks)", None, "not made: no full-gate policy (kvgate or kvgate[...]) ran")]
    for gate in gates:
        name, ratio = gate["policy"], gate["ratio_to_none"]
        # a policy whose turns failed did less work than the workload asks: its wall-clock
        # compares nothing, so every check that reads it fails, saying why
        refs = [gate, none] + [x for x in summary["policies"] if x["kind"] == "cap"]
        broken = [x for x in refs if x is not None and x["errors"]]
        if broken:
            out.append((f"{name} (no comparison)", False, "turns failed in "
                        + ", ".join(f"{x['policy']} ({x['errors']})" for x in broken)))
            continue
        rtxt = f"ratio {ratio:.3f}" if ratio is not None else "n/a"

        def vs_cap(title: str, test: Any, detail: Any) -> None:
            if bc is None:
                out.append((f"{name} {title}", None, no_cap))
            else:
                out.append((f"{name} {title} ({bc['policy']})", test(), detail()))

        def vs_none(title: str, limit: float) -> None:
            if none is None:
                out.append((f"{name} {title}", None, no_none))
            else:
                out.append((f"{name} {title}", ratio is not None and ratio <= limit, rtxt))

        if scenario == "cpu-heavy":
            vs_cap("within 10% of the best fixed cap", lambda: gate["wall_s"] <= 1.10 * bc["wall_s"],
                   lambda: f"{gate['wall_s']:.2f}s vs {bc['wall_s']:.2f}s ({gate['wall_s'] / bc['wall_s']:.3f}x)")
        elif scenario == "cpu-tiny":
            vs_none("no more than 10% slower than no gate", 1.10)
        elif scenario == "no-pressure":
            vs_none("costs <= 5% vs no gate", 1.05)
        else:
            vs_none("wall-clock <= 0.6x no gate", 0.6)
            vs_cap("beats the best fixed cap", lambda: gate["wall_s"] < bc["wall_s"],
                   lambda: f"{gate['wall_s']:.2f}s vs {bc['wall_s']:.2f}s")
            hr = gate["hit_rate"]
            ok = hr is not None and hr >= 0.9
            detail = "n/a" if hr is None else f"{hr:.3f}" + ("" if ok else _aged_reprefill(gate))
            out.append((f"{name} prefix-cache hit rate >= 0.9", ok, detail))
    return out


#: ``kvgate bench`` flags that set the workload (argparse dest, the scenario's attribute); an
#: attribute ``tool.x`` is the scenario's tool latency's ``x``
WORKLOAD_FLAGS = (("sessions", "sessions"), ("turns", "turns"), ("first_prompt", "first_prompt"),
                   ("tool_result", "tool_result"), ("output", "output"),
                   ("tool_fast_median", "tool.fast_median_s"), ("tool_slow_median", "tool.slow_median_s"),
                   ("tool_slow_frac", "tool.slow_frac"), ("tool_sigma", "tool.sigma"), ("tool_max", "tool.max_s"),
                   ("arrival_spread", "arrival_spread_s"))
#: the simulator's (ignored with --engine)
SIM_FLAGS = (("profile", "profile"), ("sim_engines", "engines"), ("kv_capacity", "kv_capacity"))
_RANGE_FLAGS = {"turns", "first_prompt", "tool_result", "output"}


def scenario_changes(args: Any, sc: Any, *, time_scale: float, caps_run: Sequence[int],
                     default_caps: Sequence[int]) -> list[str]:
    """What the flags of a ``kvgate bench`` run (``args``) changed in the workload or engines
    of its named scenario ``sc`` (a ``kvgate.tools.bench.cli.Scenario``), one ``--flag value`` each;
    empty for the scenario as the issue defines it. A flag given with the scenario's own value
    changes nothing. ``caps_run``: the fixed caps that ran; they change the scenario when they
    are not its sweep ``default_caps`` (a cap of every session is no gate, so "beats the best
    fixed cap" would compare nothing). The seed and the vocabulary only redraw token ids, and
    ``--engine`` is how the CPU scenarios are meant to run: none of them counts."""
    out = []

    def differs(dest: str, attr: str) -> bool:
        given = getattr(args, dest, None)
        if given is None:
            return False
        dflt = sc
        for part in attr.split("."):
            dflt = getattr(dflt, part)
        if dest in _RANGE_FLAGS:
            return parse_range(given) != parse_range(dflt)
        return given != dflt

    engine = bool(getattr(args, "engine", None))
    if getattr(args, "trace", None):
        out.append(f"--trace {args.trace}")
    else:
        out += [f"--{d.replace('_', '-')} {getattr(args, d)}" for d, a in WORKLOAD_FLAGS if differs(d, a)]
    if not engine:
        out += [f"--{d.replace('_', '-')} {getattr(args, d)}" for d, a in SIM_FLAGS if differs(d, a)]
        if getattr(args, "sim_prefill_metrics", False):
            out.append("--sim-prefill-metrics")
    if time_scale != (1.0 if engine else sc.time_scale):
        out.append(f"--time-scale {time_scale:g}")
    if caps_run and sorted(set(caps_run)) != sorted(set(default_caps)):
        out.append(f"caps {','.join(map(str, sorted(set(caps_run))))} "
                   f"(the scenario's sweep: {','.join(map(str, sorted(set(default_caps))))})")
    return out


def _aged_reprefill(gate: dict) -> str:
    """What a failed hit-rate check can say about itself from the run's own data: the
    re-prefill that aged turns paid (waits the gate ended, by ``max_wait_s`` or a wait-cost
    rule, whose sessions had lost their blocks), against the gate's whole re-prefill. Empty
    when no aged turn re-prefilled anything, or the engines reported no ``cached_tokens``."""
    by = gate.get("reprefill_by_admission") or {}
    aged = [v for k, v in by.items() if k.endswith("/aged")]
    tokens = sum(v["reprefill_tokens"] for v in aged)
    if not tokens:
        return ""
    total = sum(v["reprefill_tokens"] for v in by.values())
    return (f"; {sum(v['turns'] for v in aged)} aged turns re-prefilled {_tok(tokens)} of its {_tok(total)} "
            "(why: docs/benchmarks.md#max-wait-bound)")


#: the median event-loop lateness above which a run is reported as short of CPU: on the
#: project's 2-core machine the default scenario measured 0.6-0.8 ms (p50) for no gate and
#: the caps and 1-3 ms for the gate policies
LAG_P50_WARN_S = 0.005


def lag_warnings(summary: dict, time_scale: float) -> list[str]:
    """One line per policy whose bench process was short of CPU (median event-loop lateness
    over ``LAG_P50_WARN_S``): its turns, waits and samples ran late by that much, which is
    ``1/time_scale`` times more in model time, so its numbers are distorted."""
    out = []
    for x in summary["policies"]:
        lag = (x.get("loop_lag_s") or {}).get("p50")
        if lag is not None and lag > LAG_P50_WARN_S:
            out.append(f"{x['policy']}: the bench's event loop woke {lag * 1000:.1f} ms late (median; "
                       f"{lag / time_scale:.2f} s of model time at time scale {time_scale:g}): the bench was "
                       f"short of CPU and this policy's numbers are distorted; rerun on a quieter machine "
                       f"or with a larger --time-scale")
    return out


def _f(x: Any, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _tok(x: float | None) -> str:
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
             f"{wl['turns']} turns, working set {_tok(wl['working_set_tokens'])} tokens")
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
        t.add_row(name, _f(x["wall_s"]), _f(x["ratio_to_none"]), _f(x["hit_rate"], "{:.3f}"),
                  _tok(x["uncached_tokens"]), _tok(x["reprefill_tokens"]), _f(x["latency_p50_s"], "{:.3f}"),
                  _f(x["latency_p99_s"], "{:.3f}"), _f(x["late_latency_p50_s"], "{:.3f}"),
                  str(x["waits"]), _f(x["gate_preemptions"], "{:.0f}"),
                  _f(x.get("engine_preemptions"), "{:.0f}"), adm)
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
            parts = ", ".join(f"{escape(k)} {_tok(v['reprefill_tokens'])} ({v['turns']} turns)" for k, v in by.items())
            console.print(f"re-prefill by admission, {escape(x['policy'])}: {parts}")
    for x in summary["policies"]:
        rounds = x.get("rounds")
        if rounds and x["policy"] != "none":
            ratios = "" if all(r["ratio_to_none"] is None for r in rounds) else \
                "x none " + ", ".join(_f(r["ratio_to_none"]) for r in rounds) + "; "
            console.print(f"rounds, {escape(x['policy'])}: {ratios}wall "
                          + ", ".join(_f(r["wall_s"]) for r in rounds) + " s (the table: medians)")
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


def write_json(summary: dict, path: Path, extra: dict | None = None) -> None:
    data = dict(summary)
    if extra:
        data.update(extra)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")


def write_plots(summary: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for x in summary["policies"]:
        pts = [(t, h) for t, h in x["hit_rate_over_time"] if h is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=x["policy"], lw=1.2)
    ax.set_xlabel("time since step start (s, scaled)")
    ax.set_ylabel("prefix-cache hit rate (per sample window)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("Prefix-cache hit rate over time")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    p = out_dir / "hit_rate_over_time.png"
    fig.tight_layout()
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for x in summary["policies"]:
        items = sorted((int(k), v) for k, v in x["latency_by_turn_s"].items())
        if items:
            ax.plot([i for i, _ in items], [v for _, v in items], label=x["policy"], lw=1.2)
    ax.set_xlabel("turn index")
    ax.set_ylabel("mean turn latency (s, incl. gate wait)")
    ax.set_yscale("log")
    ax.set_title("Turn latency by turn index")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    p = out_dir / "latency_by_turn.png"
    fig.tight_layout()
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    return paths
