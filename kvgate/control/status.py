"""Rendering of ``Gate.status()`` for ``kvgate status`` and ``kvgate top`` (rich)."""
from __future__ import annotations

import json
import math
from typing import Any, Mapping

from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

__all__ = ["render_status", "status_json", "fmt_tokens", "fmt_pct"]


def fmt_tokens(n: Any) -> str:
    try:
        v = float(n)
    except (TypeError, ValueError):
        return "-"
    if math.isnan(v):
        return "-"
    for unit, div in (("M", 1e6), ("k", 1e3)):
        if abs(v) >= div:
            return f"{v / div:.2f}{unit}"
    return f"{int(v)}"


def fmt_pct(x: Any) -> str:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return "-"
    if v < 0 or math.isnan(v):
        return "-"
    return f"{100 * v:.1f}%"


def _bar(frac: float, width: int = 24) -> Text:
    frac = 0.0 if frac is None or math.isnan(frac) else min(max(frac, 0.0), 1.0)
    n = int(round(frac * width))
    style = "green" if frac < 0.85 else ("yellow" if frac < 0.92 else "red")
    return Text("#" * n, style=style) + Text("." * (width - n), style="dim")


def status_json(status: Mapping) -> str:
    return json.dumps(status, indent=2, sort_keys=True, default=str)


def render_status(status: Mapping, *, leader: str | None = None, title: str | None = None):
    """A rich renderable: ledger / ceiling / usage / FIFO / leases / windows / engines."""
    s = dict(status)
    degraded = bool(s.get("degraded"))
    age = s.get("snapshot_age_s")
    reserved, ceiling = s.get("reserved", 0) or 0, s.get("ceiling", 0) or 0
    util = (reserved / ceiling) if ceiling else float("nan")

    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    head.add_row("gate", str(s.get("gate", "?")))
    head.add_row("state", Text("DEGRADED (clients bypass)", style="bold red") if degraded
                 else Text("ok", style="bold green"))
    head.add_row("snapshot age", "none" if age is None else f"{float(age):.1f}s")
    head.add_row("epoch", str(s.get("epoch", "-")))
    head.add_row("ledger", Text(f"{fmt_tokens(reserved)} / {fmt_tokens(ceiling)} reserved  ")
                 + (_bar(util) if ceiling else Text("no ceiling", style="dim")))
    head.add_row("available", fmt_tokens(s.get("available")))
    head.add_row("capacity", fmt_tokens(s.get("capacity")))
    head.add_row("usage (worst)", Text(f"{fmt_pct(s.get('usage'))}  ") + _bar(float(s.get("usage") or 0)))
    if s.get("hit_rate") is not None:
        head.add_row("prefix hit rate", fmt_pct(s.get("hit_rate")))
    if s.get("prefill_s_per_token") is not None:
        load = s.get("prefill_load")
        head.add_row("prefill cost", f"{float(s['prefill_s_per_token']) * 1e6:.1f} us/token (slowest engine)"
                     + ("" if load is None else f", load {float(load):.2f} (busiest)"))
    gap = s.get("tool_gap_s")
    if gap is not None:
        head.add_row("tool gap", f"{float(gap):.3f} s (typical time between a session's turns)")
    if s.get("budget_scale") is not None:
        head.add_row("budget scale", f"{float(s['budget_scale']):.2f} x the pool's ceiling (docs/budget.md)")
    head.add_row("fifo waiting", str(s.get("waiting", 0)))
    head.add_row("leases", str(s.get("leases", 0)))
    head.add_row("windows", str(s.get("windows", 0)))
    if leader is not None:
        head.add_row("poller leader", leader or Text("none", style="red"))
    fifo_head = s.get("fifo_head") or []
    if fifo_head:
        head.add_row("fifo head", ", ".join(str(t) for t in fifo_head[:5]))

    eng = Table(title="engines", expand=False)
    eng.add_column("engine", overflow="fold", min_width=12)
    for col in ("kind", "healthy", "capacity", "used", "usage", "hit"):
        eng.add_column(col, justify="left" if col == "kind" else "right", no_wrap=True)
    for e in s.get("engines") or []:
        if not isinstance(e, Mapping):
            continue
        healthy = e.get("healthy") in (1, True, "1")
        used = e.get("used")
        eng.add_row(str(e.get("id", e.get("engine_id", "?"))), str(e.get("kind", "")),
                    Text("yes", style="green") if healthy else Text("no", style="red"),
                    fmt_tokens(e.get("cap", e.get("capacity_tokens"))),
                    "-" if used in (None, -1) else fmt_tokens(used),
                    fmt_pct(e.get("usage")), fmt_pct(e.get("hit", e.get("hit_rate"))))
    parts = [head, eng]
    totals = s.get("totals") or {}
    if totals:
        tt = Table(title="totals", expand=False)
        tt.add_column("counter")
        tt.add_column("value", justify="right")
        for k in sorted(totals):
            v = totals[k]
            tt.add_row(str(k), f"{v:g}" if isinstance(v, (int, float)) else str(v))
        parts.append(tt)
    return Panel(Group(*parts), title=title or f"kvgate {s.get('gate', '')}", expand=False,
                 border_style="red" if degraded else "blue")
