"""Scale: many client processes and many waiting sessions on one gate, one private Redis.

    python benchmarks/scale.py [--procs 64] [--sessions 10000] [--handoff-s 6] [--json] [--quick]

Starts its own redis-server (kvgate.tools.bench's embedded one; the binary is required) and,
per level of waiters (10, 1,000, then ``--sessions``), spreads that many waiting sessions over
``--procs`` client processes (fewer when there are fewer sessions than processes), each an
asyncio crowd of benchmarks/overhead.py (``run_crowd``: the same code that measures one crowd
process there). One lease fills the gate's ceiling; every admitted waiter releases at once and
queues again, so the FIFO stays as long while the gate hands its one place from head to head,
across processes, for ``--handoff-s``. Per level:

- admissions per second (hand-offs: each is one release and one admission);
- the wake-up latency from a release to the next head's admission, p50 / p99, over every
  process's events in time order (one monotonic clock per machine);
- the Redis server's microseconds per script call, and the Redis commands per admission: the
  script calls (EVALSHA) plus the commands they run, from ``INFO commandstats`` (reset before
  the hand-offs); and what one waiter's re-check costs the server (each waiter sends one per
  ``CROWD_POLL_S``, see overhead.py for why not the default ``wait_poll_s``).

``--quick`` is a smoke run (4 processes, 10 and 100 waiters, short hand-offs);
``tests/test_scale_bench.py`` runs it. docs/benchmarks.md#across-processes has the full run's figures.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if (_ROOT / "kvgate" / "__init__.py").is_file():
    sys.path.insert(0, str(_ROOT))

import redis  # noqa: E402

import kvgate  # noqa: E402
from kvgate.tools.bench.redis_embed import embedded_redis  # noqa: E402

from overhead import CROWD_POLL_S, client_kw, f, run_crowd, table  # noqa: E402  (benchmarks/overhead.py)

PROFILES = {
    "full": dict(procs=64, sessions=10_000, handoff_s=6.0),
    "quick": dict(procs=4, sessions=100, handoff_s=1.5),
}


def levels(sessions: int) -> list[int]:
    """10, 1,000 and ``sessions`` waiters (those below it)."""
    return sorted({w for w in (10, 1_000) if w < sessions} | {sessions})


def run(url: str, procs: int, sessions: int, handoff_s: float, say=lambda s: None) -> dict:
    r = redis.Redis.from_url(url, **client_kw())
    out = {"redis_version": r.info("server")["redis_version"], "kvgate": str(Path(kvgate.__file__).parent),
           "procs": procs, "sessions": sessions, "handoff_s": handoff_s, "crowd_poll_s": CROWD_POLL_S, "levels": {}}
    for w in levels(sessions):
        n = min(procs, w)
        say(f"{w} waiters in {n} processes")
        m = run_crowd(r, url, f"scale-w{w}", w, handoff_s, procs=n)
        calls = max(m["script_calls"], 1e-9)
        out["levels"][str(w)] = {
            "procs": n, "admissions": m["handoffs"], "admissions_per_s": m["handoffs_per_s"],
            "wake_p50_ms": m["wake_p50_ms"], "wake_p99_ms": m["wake_p99_ms"],
            "server_us_per_call": m["server_us"] / calls, "script_calls_per_admission": m["script_calls"],
            "commands_per_admission": m["script_calls"] + m["inner_commands"],
            "server_us_per_admission": m["server_us"], "recheck_us": m["recheck_us"],
            "not_admitted": sum(m["missed"].values()), "script_us_per_call": m["script_us_per_call"],
        }
    r.close()
    return out


def report(res: dict) -> str:
    rows = [["waiters", "processes", "admissions/s", "wake p50 ms", "wake p99 ms", "server us/call",
             "server us/admission", "scripts/admission", "commands/admission", "re-check us", "not admitted"]]
    for w, m in res["levels"].items():
        rows.append([f"{int(w):,}", str(m["procs"]), f(m["admissions_per_s"], 0), f(m["wake_p50_ms"], 2),
                     f(m["wake_p99_ms"], 2), f(m["server_us_per_call"]), f(m["server_us_per_admission"]),
                     f(m["script_calls_per_admission"], 2), f(m["commands_per_admission"], 1), f(m["recheck_us"]),
                     str(m["not_admitted"])])
    return "\n".join([f"redis-server {res['redis_version']}, kvgate from {res['kvgate']}; one gate, one place handed "
                      f"from head to head for {res['handoff_s']:g} s per level; waiters re-check every "
                      f"{res['crowd_poll_s']:g} s", "", table(rows)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run: 4 processes, 10 and 100 waiters")
    ap.add_argument("--procs", type=int, help="client processes (default 64)")
    ap.add_argument("--sessions", type=int, help="waiting sessions at the largest level (default 10,000)")
    ap.add_argument("--handoff-s", type=float, help="seconds of hand-offs per level (default 6)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    a = ap.parse_args(argv)
    prof = dict(PROFILES["quick" if a.quick else "full"])
    for k in ("procs", "sessions", "handoff_s"):
        if getattr(a, k) is not None:
            prof[k] = getattr(a, k)
    if prof["procs"] < 1 or prof["sessions"] < 1 or not prof["handoff_s"] > 0:
        ap.error("--procs and --sessions must be >= 1, --handoff-s > 0")
    t0 = time.monotonic()

    def say(what: str) -> None:  # progress on stderr: the figures go to stdout alone
        print(f"[{time.monotonic() - t0:6.1f}s] {what}", file=sys.stderr, flush=True)

    with embedded_redis("redis-server") as (url, _kind):
        res = run(url, prof["procs"], prof["sessions"], prof["handoff_s"], say)
    res["elapsed_s"] = time.monotonic() - t0
    print(json.dumps(res, indent=1) if a.json else report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
