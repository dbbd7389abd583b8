"""Per-step metrics (the flat ``agentic_kv/...`` dict of seed 003 plus the seed-000
signals), the operators' status dict, and a Prometheus collector with the same numbers.

The scripts count every outcome once, in cumulative totals (``:totals``, exported to
Prometheus); a rollout step's window is the totals less their values when the step began
(``:stats``, which ``Gate.step_metrics()`` moves on once per step: lua/drain_stats.lua).
Outcomes decided without Redis (pass-through, degraded while Redis is unreachable) are
counted per process and merged in.
"""
from __future__ import annotations

import json
from typing import Any

P = "agentic_kv/"
ADMIT_REASONS = ("open", "reserved_session", "resident_prefix", "prefix_probe_unavailable", "aged")
BYPASS_REASONS = ("protected", "degraded", "aged")
WAIT_REASONS = ("pressure_guard", "capacity_exhausted", "queued", "cold_prefix")


def _f(d: dict, k: str) -> float:
    try:
        return float(d.get(k, 0) or 0)
    except (TypeError, ValueError):
        return 0.0


def build_step_metrics(raw: dict | None, config: Any, local: dict) -> dict[str, float]:
    """Turn drain_stats.lua's reply (None when Redis is unreachable) into the flat dict."""
    st = dict((raw or {}).get("stats") or {})
    # merge what this process decided without Redis
    for k, v in local.items():
        if k == "pass":
            continue
        st[k] = _f(st, k) + v
    m: dict[str, float] = {}
    admit, bypass, wait = _f(st, "admit"), _f(st, "bypass"), _f(st, "wait")
    total = admit + bypass + wait
    m[P + "admission/admit"] = admit
    m[P + "admission/bypass"] = bypass
    m[P + "admission/wait"] = wait
    m[P + "admission/cancelled"] = _f(st, "cancelled")
    m[P + "admission/preempted"] = _f(st, "preempted")
    m[P + "admission/pass_through"] = float(local.get("pass", 0))
    for r in BYPASS_REASONS:
        m[P + f"admission/bypass_{r}"] = _f(st, f"bypass_{r}")
    for r in ADMIT_REASONS:
        m[P + f"admission/admit_{r}"] = _f(st, f"admit_{r}")
    for r in WAIT_REASONS:
        m[P + f"admission/wait_{r}"] = _f(st, f"wait_{r}")
    for k in ("window_revoked", "window_yielded", "window_expired"):
        m[P + f"residency/{k}"] = _f(st, k)
    # shared prefixes (docs/concepts.md#shared-prefixes): tokens charged once for a prefix
    # its first holder brought, admissions that found their prefix charged already (a
    # sibling's), and the tokens those were not charged again
    m[P + "sharing/prefix_charged_tokens"] = _f(st, "prefix_charged")
    m[P + "sharing/group_admit"] = _f(st, "group_admit")
    m[P + "sharing/saved_tokens"] = _f(st, "prefix_saved")
    m[P + "admission/defer_rate"] = wait / total if total else 0.0
    m[P + "admission/degraded_rate"] = _f(st, "bypass_degraded") / total if total else 0.0
    granted = _f(st, "wait_granted")
    m[P + "admission/wait_seconds_mean"] = (_f(st, "wait_ms_sum") / 1000.0 / granted) if granted else 0.0
    if raw is not None:
        # the ceiling the scripts admit against: capacity x headroom x the budget scale
        ceiling = float(raw.get("ceiling", 0) or 0)
        reserved = float(raw.get("reserved", 0) or 0)
        age = float(raw.get("snapshot_age_ms", -1))
        fresh = 0 <= age <= config.staleness_s * 1000 and float(raw.get("n_healthy", 0)) > 0
        m[P + "admission/waiting"] = float(raw.get("waiting", 0))
        m[P + "budget/ceiling"] = ceiling
        m[P + "budget/scale"] = float(raw.get("budget_scale", 1) or 1)
        m[P + "budget/reserved"] = reserved
        m[P + "budget/available_tokens"] = max(0.0, ceiling - reserved)
        m[P + "budget/reserved_utilization"] = reserved / ceiling if ceiling else 0.0
        # what the ledger would hold if every holder were charged its shared prefix too
        m[P + "budget/reserved_unshared"] = reserved + float(raw.get("psaved", 0) or 0)
        m[P + "sharing/prefixes"] = float(raw.get("prefixes", 0) or 0)
        m[P + "budget/lease_count"] = float(raw.get("leases", 0))
        m[P + "budget/window_count"] = float(raw.get("windows", 0))
        m[P + "budget/epoch"] = float(raw.get("epoch", 0))
        m[P + "budget/degraded"] = 0.0 if fresh else 1.0
        # num_preempted per session (seed 000): how many live sessions had an attempt
        # preempted, and the most any one had; gate.num_preempted(sid) gives one session's
        m[P + "admission/preempted_sessions"] = float(raw.get("preempted_sessions", 0) or 0)
        m[P + "admission/preempted_max_per_session"] = float(raw.get("preempted_max", 0) or 0)
        hit = float(raw.get("hit_rate", -1))
        if hit >= 0:
            m[P + "residency/prefix_cache_hit_rate"] = hit
    else:
        m[P + "budget/degraded"] = 1.0
    m[P + "budget/lease_expired"] = _f(st, "lease_expired")
    # releases and cancels this process could not send (Redis faulted or its breaker was
    # open), kept to send once Redis answers; dropped ones are left to lease_ttl_s
    m[P + "client/deferred"] = _f(st, "deferred")
    m[P + "client/deferred_dropped"] = _f(st, "deferred_dropped")
    # releases and cancels sent again because the state came from another Redis (a failover)
    m[P + "client/replayed"] = _f(st, "replayed")
    n = _f(st, "usage_n")
    if n:
        m[P + "budget/kv_token_usage_mean"] = _f(st, "usage_sum") / n
        m[P + "budget/kv_token_usage_max"] = _f(st, "usage_max")
    # the close counters come with the reader's lifecycle setting, or whenever another
    # process of the gate (with lifecycle on) counted closes this step: a driver that reads
    # the step with its own config must not drain them unseen
    if config.session_lifecycle or _f(st, "close") or _f(st, "close_failure"):
        m[P + "session/lifecycle_enabled"] = 1.0 if config.session_lifecycle else 0.0
        m[P + "session/close"] = _f(st, "close")
        m[P + "session/close_failure"] = _f(st, "close_failure")
    for k in st:
        if k.startswith("lat_n:"):
            idx = k.split(":", 1)[1]
            cnt = _f(st, k)
            if cnt:
                m[P + f"latency/turn_{idx}_mean_s"] = _f(st, f"lat_us_sum:{idx}") / 1e6 / cnt
    return m


def build_status(name: str, config: Any, raw: dict, engines_json: Any, head: list, totals: dict) -> dict:
    """The gate's state for operators (``Gate.status()``), from drain_stats.lua's reply (read
    with drain=0, by the Redis clock) and a few plain reads."""
    def txt(v: Any) -> Any:
        return v.decode() if isinstance(v, bytes) else v
    cap = int(raw.get("capacity", 0) or 0)
    ceiling = int(raw.get("ceiling", 0) or 0)  # capacity x headroom x the budget scale
    reserved = int(raw.get("reserved", 0) or 0)
    age_ms = float(raw.get("snapshot_age_ms", -1))
    age = age_ms / 1000.0 if age_ms >= 0 else None
    try:
        engines = json.loads(txt(engines_json)) if engines_json else []
    except ValueError:
        engines = []
    if not isinstance(engines, list):
        engines = []
    fresh = age is not None and age <= config.staleness_s and int(raw.get("n_healthy", 0) or 0) > 0
    hit = float(raw.get("hit_rate", -1))
    pst = float(raw.get("prefill_s_per_token", -1))
    pl = float(raw.get("prefill_load", -1))
    gap = float(raw.get("tool_gap_s", -1))
    return {
        "gate": name, "reserved": reserved, "ceiling": ceiling, "capacity": cap,
        "available": max(0, ceiling - reserved), "usage": float(raw.get("usage", 0) or 0),
        "epoch": int(raw.get("epoch", 0) or 0), "waiting": int(raw.get("waiting", 0)),
        "leases": int(raw.get("leases", 0)), "windows": int(raw.get("windows", 0)),
        "snapshot_age_s": age, "degraded": not fresh, "hit_rate": hit if hit >= 0 else None,
        "prefill_s_per_token": pst if pst >= 0 else None, "prefill_load": pl if pl >= 0 else None,
        "tool_gap_s": gap if gap >= 0 else None,
        "budget_scale": float(raw.get("budget_scale", 1) or 1),
        "preempted_sessions": int(raw.get("preempted_sessions", 0) or 0),
        "preempted_max": int(raw.get("preempted_max", 0) or 0),
        "prefixes": int(raw.get("prefixes", 0) or 0),
        "reserved_unshared": reserved + int(raw.get("psaved", 0) or 0),
        "engines": engines, "fifo_head": [txt(t) for t, _ in head],
        "totals": {txt(k): float(v) for k, v in totals.items()},
    }


class GateCollector:
    """A prometheus_client custom collector: gate-wide gauges and cumulative counters,
    read from Redis at scrape time (one pipeline). Register it in a CollectorRegistry."""

    def __init__(self, gate: Any):
        self.gate = gate

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        try:
            s = self.gate.status()
        except Exception:  # noqa: BLE001 - a scrape must never raise
            g = GaugeMetricFamily("kvgate_up", "1 when the gate's Redis answered this scrape", labels=["gate"])
            g.add_metric([self.gate.name], 0.0)
            yield g
            return
        gate = [self.gate.name]
        up = GaugeMetricFamily("kvgate_up", "1 when the gate's Redis answered this scrape", labels=["gate"])
        up.add_metric(gate, 1.0)
        yield up
        for name, help_, val in (
            ("kvgate_reserved_tokens", "Tokens reserved by live leases and windows", s["reserved"]),
            ("kvgate_ceiling_tokens", "Admission ceiling (healthy capacity x headroom x budget scale)", s["ceiling"]),
            ("kvgate_budget_scale", "Budget scale in use: the measured one, the budget_scale knob, or 1 "
             "(docs/budget.md)", s.get("budget_scale", 1.0)),
            ("kvgate_kv_usage", "Worst engine KV usage in the latest snapshot", s["usage"]),
            ("kvgate_epoch", "Generation of the healthy engine set", s["epoch"]),
            ("kvgate_waiting", "Attempts waiting in the FIFO", s["waiting"]),
            ("kvgate_leases", "Live leases", s["leases"]),
            ("kvgate_windows", "Ownership windows (held or in idle grace)", s["windows"]),
            ("kvgate_degraded", "1 when there is no fresh snapshot", 1.0 if s["degraded"] else 0.0),
            ("kvgate_snapshot_age_seconds", "Age of the latest snapshot",
             s["snapshot_age_s"] if s["snapshot_age_s"] is not None else float("nan")),
            ("kvgate_prefix_cache_hit_rate", "Mean engine prefix-cache hit rate (engines' own metric)",
             s["hit_rate"] if s["hit_rate"] is not None else float("nan")),
            ("kvgate_preempted_sessions", "Live sessions with at least one preempted attempt",
             s.get("preempted_sessions", 0)),
            ("kvgate_preempted_max_per_session", "Most preempted attempts of one live session",
             s.get("preempted_max", 0)),
            ("kvgate_shared_prefixes", "Shared prefixes charged once in the ledger now", s.get("prefixes", 0)),
            ("kvgate_reserved_unshared_tokens", "Tokens the ledger would reserve if every holder were charged "
             "its shared prefix too", s.get("reserved_unshared", s["reserved"])),
        ):
            g = GaugeMetricFamily(name, help_, labels=["gate"])
            g.add_metric(gate, float(val))
            yield g
        t = s["totals"]
        adm = CounterMetricFamily("kvgate_admissions", "Admitted attempts by reason", labels=["gate", "reason"])
        for r in ADMIT_REASONS:
            adm.add_metric(gate + [r], t.get(f"admit_{r}", 0.0))
        yield adm
        byp = CounterMetricFamily("kvgate_bypasses", "Bypassed attempts by reason", labels=["gate", "reason"])
        for r in BYPASS_REASONS:
            byp.add_metric(gate + [r], t.get(f"bypass_{r}", 0.0))
        yield byp
        waits = CounterMetricFamily("kvgate_waits", "Attempts that entered the FIFO by reason",
                                    labels=["gate", "reason"])
        for r in WAIT_REASONS:
            waits.add_metric(gate + [r], t.get(f"wait_{r}", 0.0))
        yield waits
        for name, field, help_ in (
            ("kvgate_cancelled", "cancelled", "Attempts cancelled by their callers"),
            ("kvgate_preempted", "preempted", "Waiting attempts preempted by a newer attempt"),
            ("kvgate_lease_expired", "lease_expired", "Leases reclaimed by TTL"),
            ("kvgate_dead_waiters", "dead_waiter", "Waiters dropped after their liveness deadline"),
            ("kvgate_session_close", "close", "Session close attempts"),
            ("kvgate_session_close_failures", "close_failure", "Session close failures"),
            ("kvgate_wait_seconds", "wait_ms_sum", "Total seconds granted attempts waited"),
            ("kvgate_window_revoked", "window_revoked", "Ownership windows revoked (trim, yield)"),
            ("kvgate_window_yielded", "window_yielded", "Idle windows ended to make room for an aged waiter"),
            ("kvgate_window_expired", "window_expired", "Ownership windows whose idle grace expired"),
            ("kvgate_epoch_bumps", "epoch_bumps", "Changes of the healthy engine set"),
            ("kvgate_group_admissions", "group_admit", "Admissions whose shared prefix another holder had "
             "charged already (a sibling's)"),
            ("kvgate_prefix_charged_tokens", "prefix_charged", "Shared prefix tokens charged, once per prefix"),
            ("kvgate_prefix_saved_tokens", "prefix_saved", "Tokens not charged again: the shared prefixes of "
             "group admissions"),
        ):
            c = CounterMetricFamily(name, help_, labels=["gate"])
            v = t.get(field, 0.0)
            c.add_metric(gate, v / 1000.0 if field == "wait_ms_sum" else v)
            yield c
        lat = GaugeMetricFamily("kvgate_turn_latency_seconds_mean", "Mean turn latency by turn index",
                                labels=["gate", "turn_index"])
        for k, v in t.items():
            if k.startswith("lat_n:") and v:
                idx = k.split(":", 1)[1]
                lat.add_metric(gate + [idx], t.get(f"lat_us_sum:{idx}", 0.0) / 1e6 / v)
        yield lat
