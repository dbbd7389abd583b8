"""What a bench run measured, per policy: the summary rows behind the table, the JSON and the
checks, and one summary from several rounds."""
from __future__ import annotations

import json
import math
import statistics
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Sequence

from .runner import PolicyResult
from .workload import Workload

__all__ = ["summarize", "combine_rounds", "write_json", "straggler", "paired_ratio", "better_baseline"]


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


def _shared_seen(turns: Sequence[Any], workload: Workload | None) -> dict[str, int]:
    """Session -> the leading tokens of its first prompt that another session's first turn sent
    before it started: its group's shared prompt when a sibling came first, else the system
    prompt when anyone did (workload.py ``turn_tokens``: those ids are identical)."""
    if workload is None:
        return {}
    info = {s.session_id: s for s in workload.sessions}
    firsts = sorted((ts[0] for ts in _by_session(turns).values() if ts[0].turn == 0), key=lambda t: t.start_s)
    groups: set[str] = set()
    out: dict[str, int] = {}
    for k, t in enumerate(firsts):
        s = info.get(t.session)
        if s is None:
            continue
        seen = s.shared_tokens if s.group is not None and s.group in groups else (workload.system_tokens if k else 0)
        if seen > 0:
            out[t.session] = seen
        if s.group is not None:
            groups.add(s.group)
    return out


def _first_seen(t: Any, shared: dict[str, int], block: int | None) -> int:
    """Of a first turn's prompt, what a cache that kept everything could have served from the
    sessions that came before it (:func:`_shared_seen`): whole blocks, at most ``input - 1``."""
    n = min(shared.get(t.session, 0), t.prompt_tokens - 1)
    return (n // block) * block if block else max(n, 0)


def _unavoidable_tokens(turns: Sequence[Any], block: int, resets: Any = frozenset(),
                        shared: dict[str, int] | None = None) -> int:
    """Prompt tokens no cache could have served, turn by turn, from the turn records: a first
    turn's (or a reset's) whole prompt, less the prefix it shares with a session that came
    first (``shared``: :func:`_shared_seen`); a continuation's prompt minus :func:`_reusable`
    from the session's previous record (the last one that reached the engine, when a turn
    failed)."""
    n = 0
    for ts in _by_session(turns).values():
        prev = None
        for t in ts:
            if prev is not None and _continues(prev, t, resets):
                n += t.prompt_tokens - _reusable(prev, t, block)
            else:
                n += t.prompt_tokens - (_first_seen(t, shared, block) if shared and prev is None else 0)
            prev = t
    return n


def summarize(results: Sequence[PolicyResult], workload: Workload, block_size: int | None = None) -> dict:
    """One dict per policy plus the comparisons (ratios to ``none``, best cap).

    ``block_size``: the engines' KV block (page) size, when known. Re-prefill is then the
    uncached tokens beyond those a cache that kept everything could not have served, turn by
    turn (:func:`_unavoidable_tokens`: engines reuse whole blocks only); without it, the
    uncached tokens beyond the workload's fresh tokens (first prompts with each shared prefix
    once, tool results), which also counts each turn's partial last block
    (``reprefill_tokens_beyond_fresh``, always in the row)."""
    fresh = workload.distinct_prompt_tokens()
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
        shared = _shared_seen(r.turns, workload)
        unavoidable = _unavoidable_tokens(r.turns, block, resets, shared) if block else fresh
        rows.append({
            "policy": r.policy.name,
            "kind": r.policy.kind,
            "cap": r.policy.cap,
            "wall_s": r.wall_s,
            "step_walls": list(r.step_walls),
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
            "reprefill_by_admission": _reprefill_by_admission(r.turns, block, resets, shared),
            "sessions": _session_rows(r.turns, n_turns_sess),
            "loop_lag_s": {"p50": _pct(r.loop_lags, 0.5), "p99": _pct(r.loop_lags, 0.99),
                           "max": max(r.loop_lags) if r.loop_lags else None, "n": len(r.loop_lags)},
            "step_metrics": r.step_metrics,
            "gate": r.gate_config,
        })
    base = next((x for x in rows if x["policy"] == "none"), None)
    for x in rows:
        x["ratio_to_none"] = (x["wall_s"] / base["wall_s"]) if base and base["wall_s"] > 0 else None
    return {"workload": workload.describe(), "policies": rows, "best_cap": _mark_best_cap(rows),
            "block_size": block}


def _mark_best_cap(rows: Sequence[dict]) -> str | None:
    """Mark the fixed cap with the lowest wall-clock (``best_cap``; a tie goes to the first,
    the smaller cap) among those without failed turns, and return its name."""
    caps = [x for x in rows if x["kind"] == "cap" and not x["errors"]]
    best = min(caps, key=lambda x: x["wall_s"]) if caps else None
    for x in rows:
        x["best_cap"] = bool(best is not None and x is best)
    return best["policy"] if best else None


def combine_rounds(summaries: Sequence[dict]) -> dict:
    """One summary from ``--rounds`` summaries of the same policies (one per round, each
    policy run once per round, side by side). Each policy's row is its median round (the round
    whose wall-clock is nearest the median: its series, sessions and step metrics), with
    ``wall_s`` and ``hit_rate`` the medians over the rounds, ``ratio_to_none`` the median of the
    per-round ratios (each measured side by side), ``reprefill_tokens`` the median over the
    rounds, ``errors`` summed over the rounds, and ``rounds`` listing every round's wall-clock,
    ratio, hit rate and re-prefill. The best cap is the cap with the lowest median wall-clock.
    One summary comes back as it is."""
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
                   reprefill_tokens=med([x["reprefill_tokens"] for x in per]),
                   errors=sum(x["errors"] for x in per),
                   error_examples=[e for x in per for e in x["error_examples"]][:5],
                   rounds=[{"wall_s": x["wall_s"], "ratio_to_none": x["ratio_to_none"], "hit_rate": x["hit_rate"],
                            "reprefill_tokens": x["reprefill_tokens"]} for x in per])
        rows.append(row)
    return {"workload": summaries[0]["workload"], "policies": rows, "best_cap": _mark_best_cap(rows),
            "block_size": summaries[0].get("block_size")}


def paired_ratio(row: dict, ref: dict) -> float | None:
    """``row``'s wall-clock over ``ref``'s: with rounds, the median of the per-round ratios
    (each measured side by side, as ``ratio_to_none``), else the one ratio. None when ``ref``
    took no time."""
    a, b = row.get("rounds"), ref.get("rounds")
    if a and b and len(a) == len(b):
        ratios = [x["wall_s"] / y["wall_s"] for x, y in zip(a, b) if y["wall_s"] > 0]
        return statistics.median(ratios) if ratios else None
    return row["wall_s"] / ref["wall_s"] if ref["wall_s"] > 0 else None


def better_baseline(summary: dict) -> dict | None:
    """The faster, by median wall-clock, of no gate and the best fixed cap (no gate on a tie:
    it needs no sweep); the one that ran when the other did not; None when neither ran."""
    rows = {x["policy"]: x for x in summary["policies"]}
    found = [x for x in (rows.get("none"), rows.get(summary.get("best_cap") or "")) if x is not None]
    return min(found, key=lambda x: x["wall_s"]) if found else None


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


def straggler(policy_row: dict) -> dict | None:
    """The session that finished last (the step's wall-clock ends with it), from a policy row's
    ``sessions`` (ordered by end); None without session rows. Its split says what made the step
    long: gate waits (the gate held the straggler back), engine time, or its own tool calls."""
    rows = policy_row.get("sessions") or []
    return rows[-1] if rows else None


def _reprefill_by_admission(turns: Sequence[Any], block: int | None = None,
                            resets: Any = frozenset(),
                            shared: dict[str, int] | None = None) -> dict[str, dict[str, int]] | None:
    """Which admissions paid for the re-prefill: per admission (``admit/aged``, ``-`` for an
    ungated turn), the turns and the prompt tokens the engine computed although it had seen
    them before. Read from the responses' ``cached_tokens``, turn by turn: a turn's new tokens
    are its prompt minus the previous turn's prompt and output (its whole prompt for a first
    turn or a reset context, less the prefix it shares with a session that came first:
    ``shared``); whatever else was not cached is re-prefill. With the block size
    known, only what a cache that kept everything could have served counts as seen
    (:func:`_reusable`: whole blocks, at most ``input - 1`` tokens). ``None`` when the engines
    report no ``cached_tokens``."""
    out: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    seen = False
    for ts in _by_session(turns).values():
        prev = None
        for t in ts:
            seen_before = _first_seen(t, shared, block) if shared and prev is None else 0
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


def write_json(summary: dict, path: Path, extra: dict | None = None) -> None:
    data = dict(summary)
    if extra:
        data.update(extra)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
