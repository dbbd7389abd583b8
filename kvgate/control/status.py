"""Rendering of ``Gate.status()`` for ``kvgate status`` and ``kvgate top``: with rich (the
``bench`` extra) a panel of tables, without it plain text with the same rows.

The rows are built once (:func:`status_parts`, as (text, style) segments); the two
renderers only lay them out.
"""
from __future__ import annotations

import json
import math
from typing import Any, Mapping

__all__ = ["render_status", "render_status_text", "status_parts", "status_json", "fmt_tokens", "fmt_pct",
           "have_rich"]

#: a cell: (text, rich style or None) segments, shown one after another
Cell = list[tuple[str, "str | None"]]


def have_rich() -> bool:
    """Whether rich (the ``bench`` extra) can be imported."""
    import importlib.util

    return importlib.util.find_spec("rich") is not None


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


def _bar(frac: float, width: int = 24) -> Cell:
    frac = 0.0 if frac is None or math.isnan(frac) else min(max(frac, 0.0), 1.0)
    n = int(round(frac * width))
    style = "green" if frac < 0.85 else ("yellow" if frac < 0.92 else "red")
    return [("#" * n, style), ("." * (width - n), "dim")]


def status_json(status: Mapping) -> str:
    return json.dumps(status, indent=2, sort_keys=True, default=str)


def status_parts(status: Mapping, *, leader: str | None = None) -> tuple[list, list, list, bool]:
    """The rows of a status view: (head rows as (label, cell), engine rows as cells,
    totals as (counter, value), degraded)."""
    s = dict(status)
    degraded = bool(s.get("degraded"))
    age = s.get("snapshot_age_s")
    reserved, ceiling = s.get("reserved", 0) or 0, s.get("ceiling", 0) or 0
    util = (reserved / ceiling) if ceiling else float("nan")

    def plain(text: Any) -> Cell:
        return [(str(text), None)]

    head: list[tuple[str, Cell]] = [
        ("gate", plain(s.get("gate", "?"))),
        ("state", [("DEGRADED (clients bypass)", "bold red")] if degraded else [("ok", "bold green")]),
        ("snapshot age", plain("none" if age is None else f"{float(age):.1f}s")),
        ("epoch", plain(s.get("epoch", "-"))),
        ("ledger", plain(f"{fmt_tokens(reserved)} / {fmt_tokens(ceiling)} reserved  ")
         + (_bar(util) if ceiling else [("no ceiling", "dim")])),
        ("available", plain(fmt_tokens(s.get("available")))),
        ("capacity", plain(fmt_tokens(s.get("capacity")))),
        ("usage (worst)", plain(f"{fmt_pct(s.get('usage'))}  ") + _bar(float(s.get("usage") or 0))),
    ]
    if s.get("hit_rate") is not None:
        head.append(("prefix hit rate", plain(fmt_pct(s.get("hit_rate")))))
    if s.get("prefill_s_per_token") is not None:
        load = s.get("prefill_load")
        head.append(("prefill cost", plain(f"{float(s['prefill_s_per_token']) * 1e6:.1f} us/token (slowest engine)"
                                           + ("" if load is None else f", load {float(load):.2f} (busiest)"))))
    gap = s.get("tool_gap_s")
    if gap is not None:
        head.append(("tool gap", plain(f"{float(gap):.3f} s (typical time between a session's turns)")))
    if s.get("budget_scale") is not None:
        head.append(("budget scale", plain(f"{float(s['budget_scale']):.2f} x the pool's ceiling (docs/budget.md)")))
    head += [("fifo waiting", plain(s.get("waiting", 0))), ("leases", plain(s.get("leases", 0))),
             ("windows", plain(s.get("windows", 0)))]
    if s.get("prefixes"):
        # shared prefixes (docs/concepts.md#shared-prefixes): charged once, and what that saves
        saved = (s.get("reserved_unshared") or reserved) - reserved
        head.append(("shared prefixes", plain(f"{s['prefixes']} charged once; {fmt_tokens(saved)} not charged again")))
    if leader is not None:
        head.append(("poller leader", plain(leader) if leader else [("none", "red")]))
    fifo_head = s.get("fifo_head") or []
    if fifo_head:
        head.append(("fifo head", plain(", ".join(str(t) for t in fifo_head[:5]))))

    engines: list[list[Cell]] = []
    for e in s.get("engines") or []:
        if not isinstance(e, Mapping):
            continue
        healthy = e.get("healthy") in (1, True, "1")
        used = e.get("used")
        engines.append([plain(e.get("id", e.get("engine_id", "?"))), plain(e.get("kind", "")),
                        [("yes", "green")] if healthy else [("no", "red")],
                        plain(fmt_tokens(e.get("cap", e.get("capacity_tokens")))),
                        plain("-" if used in (None, -1) else fmt_tokens(used)),
                        plain(fmt_pct(e.get("usage"))), plain(fmt_pct(e.get("hit", e.get("hit_rate"))))])
    totals = s.get("totals") or {}
    total_rows = [(str(k), f"{totals[k]:g}" if isinstance(totals[k], (int, float)) else str(totals[k]))
                  for k in sorted(totals)]
    return head, engines, total_rows, degraded


_ENGINE_COLUMNS = ("engine", "kind", "healthy", "capacity", "used", "usage", "hit")


def render_status(status: Mapping, *, leader: str | None = None, title: str | None = None):
    """A rich renderable: ledger / ceiling / usage / FIFO / leases / windows / engines."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    head_rows, engine_rows, totals, degraded = status_parts(status, leader=leader)

    def text(cell: Cell) -> Text:
        return Text.assemble(*[(t, st or "") for t, st in cell])

    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    for label, cell in head_rows:
        head.add_row(label, text(cell))

    eng = Table(title="engines", expand=False)
    eng.add_column("engine", overflow="fold", min_width=12)
    for col in _ENGINE_COLUMNS[1:]:
        eng.add_column(col, justify="left" if col == "kind" else "right", no_wrap=True)
    for row in engine_rows:
        eng.add_row(*[text(c) for c in row])
    parts = [head, eng]
    if totals:
        tt = Table(title="totals", expand=False)
        tt.add_column("counter")
        tt.add_column("value", justify="right")
        for k, v in totals:
            tt.add_row(k, v)
        parts.append(tt)
    return Panel(Group(*parts), title=title or f"kvgate {dict(status).get('gate', '')}", expand=False,
                 border_style="red" if degraded else "blue")


def render_status_text(status: Mapping, *, leader: str | None = None, title: str | None = None) -> str:
    """The same view as plain text (no rich): aligned label / value lines, then the engines
    and the totals as columns."""
    head_rows, engine_rows, totals, _ = status_parts(status, leader=leader)

    def text(cell: Cell) -> str:
        return "".join(t for t, _ in cell)

    def columns(header: tuple, rows: list) -> list[str]:
        widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
        return ["  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip() for r in (header, *rows)]

    width = max(len(label) for label, _ in head_rows)
    lines = [title or f"kvgate {dict(status).get('gate', '')}", ""]
    lines += [f"{label.ljust(width)}  {text(cell)}" for label, cell in head_rows]
    lines += ["", "engines"] + columns(_ENGINE_COLUMNS, [[text(c) for c in r] for r in engine_rows])
    if totals:
        lines += ["", "totals"] + columns(("counter", "value"), totals)
    return "\n".join(lines)
