"""The PNG plots of one scenario's run: hit rate over time and latency by turn index."""
from __future__ import annotations

from pathlib import Path

__all__ = ["write_plots"]


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
