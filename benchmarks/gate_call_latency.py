"""What one turn costs in the gate's client on an idle event loop: ``AsyncGate.turn`` admit and release.

    python benchmarks/gate_call_latency.py [--redis URL] [--turns 300] [--prompt 5000] [--sessions 20]

Without ``--redis`` it starts a private ``redis-server`` (kvgate.tools.bench's embedded one; fakeredis
if the binary is missing, which measures fakeredis, not a server). Every turn is admitted at
once (a 1M-token pool at 10 % usage): this is the floor under the client's cost, one Lua script
per admit and one per release over loopback, with nothing else on the loop. Compare it with the
gate's per-turn cost inside the bench to see how much of that is the bench's own busy loop. Prints p50 / p90 in milliseconds; the first 50 turns are warm-up.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import time

import kvgate
from kvgate.tools.bench.redis_embed import embedded_redis


async def measure(url: str, turns: int, prompt: int, sessions: int) -> dict:
    cfg = kvgate.GateConfig(admission=True, residency=True)
    g = kvgate.AsyncGate.from_url(url, gate=f"latency-{time.time_ns()}", config=cfg)
    try:
        await g.write_snapshot([kvgate.EngineState(engine_id="e", capacity_tokens=1_000_000, usage=0.1,
                                                   url="http://127.0.0.1:9", kind="sglang")])
        ids = list(range(3, 3 + prompt))
        admit, release, reasons = [], [], {}
        for i in range(turns):
            t0 = time.perf_counter()
            async with g.turn(f"s{i % sessions}", prompt_ids=ids, max_new_tokens=50) as lease:
                t1 = time.perf_counter()
            t2 = time.perf_counter()
            key = f"{lease.outcome}/{lease.reason}"
            reasons[key] = reasons.get(key, 0) + 1
            if i >= min(50, turns // 2):
                admit.append(t1 - t0)
                release.append(t2 - t1)
    finally:
        await g.aclose()

    def q(xs: list[float], p: float) -> float:
        xs = sorted(xs)
        return round(xs[min(len(xs) - 1, int(p * len(xs)))] * 1000, 3)

    return {"turns_measured": len(admit), "admit_ms_p50": q(admit, 0.5), "admit_ms_p90": q(admit, 0.9),
            "release_ms_p50": q(release, 0.5), "release_ms_p90": q(release, 0.9), "outcomes": reasons}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--redis", help="redis:// URL (default: a private redis-server)")
    ap.add_argument("--turns", type=int, default=300)
    ap.add_argument("--prompt", type=int, default=5000, help="prompt tokens per turn")
    ap.add_argument("--sessions", type=int, default=20)
    a = ap.parse_args()
    if a.turns < 2 or a.prompt < 1 or a.sessions < 1:
        ap.error("--turns must be >= 2, --prompt and --sessions >= 1")
    with contextlib.ExitStack() as stack:
        if a.redis:
            url, kind = a.redis, "external"
        else:
            url, kind = stack.enter_context(embedded_redis("auto"))
        out = asyncio.run(measure(url, a.turns, a.prompt, a.sessions))
    print({"redis": kind, **out})


if __name__ == "__main__":
    main()
