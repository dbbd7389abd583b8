"""Scale: many client processes and many waiting sessions on one gate, one private Redis.

    python benchmarks/scale.py [--procs 64] [--sessions 10000] [--handoff-s 6] [--json] [--quick]
    python benchmarks/scale.py --cluster [--gates 3] [...]

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
  script calls (FCALL, or EVALSHA) plus the commands they run, from ``INFO commandstats`` (reset before
  the hand-offs); and what one waiter's re-check costs the server (each waiter sends one per
  ``CROWD_POLL_S``, see overhead.py for why not the default ``wait_poll_s``).

``--cluster`` runs the same on a private 3-node Redis Cluster (kvgate.tools.bench's
``embedded_cluster``; redis-server and redis-cli are required) with ``--gates`` gates, each
its own hash tag, spread over the nodes (one gate per node when there are as many gates as
nodes), every client reaching the cluster as ``Gate.from_url(..., cluster=True)`` does. Each
level's waiters and ``--procs`` are the totals over the gates, split evenly, one crowd of
processes per gate; the gates hand off at the same time. Per level it reports each gate's
figures (its server figures are its node's, over the admissions of the gates on that node),
every gate's together (INFO commandstats summed over the nodes), and each node's.

``--quick`` is a smoke run (4 processes, 10 and 100 waiters, short hand-offs);
``tests/test_scale_bench.py`` runs it, and with ``--cluster``. docs/benchmarks.md#across-processes
has the full runs' figures.
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
from kvgate.tools.bench.redis_embed import embedded_cluster, embedded_redis  # noqa: E402

from overhead import (CROWD_POLL_S, client_kw, f, node_of, run_crowd, run_crowds,  # noqa: E402
                      server_nodes, table)  # (benchmarks/overhead.py)

PROFILES = {
    "full": dict(procs=64, sessions=10_000, handoff_s=6.0),
    "quick": dict(procs=4, sessions=100, handoff_s=1.5),
}


def levels(sessions: int) -> list[int]:
    """10, 1,000 and ``sessions`` waiters (those below it)."""
    return sorted({w for w in (10, 1_000) if w < sessions} | {sessions})


def figures(m: dict, procs: int) -> dict:
    """One crowd's figures (run_crowd's, or run_crowds' per gate or in total) per admission."""
    calls = max(m["script_calls"], 1e-9)
    return {"procs": procs, "admissions": m["handoffs"], "admissions_per_s": m["handoffs_per_s"],
            "wake_p50_ms": m["wake_p50_ms"], "wake_p99_ms": m["wake_p99_ms"],
            "server_us_per_call": m["server_us"] / calls, "script_calls_per_admission": m["script_calls"],
            "commands_per_admission": m["script_calls"] + m["inner_commands"],
            "server_us_per_admission": m["server_us"], "recheck_us": m["recheck_us"],
            "not_admitted": sum(m["missed"].values()), "script_us_per_call": m["script_us_per_call"]}


def header(r: redis.Redis, procs: int, sessions: int, handoff_s: float) -> dict:
    return {"redis_version": r.info("server")["redis_version"], "kvgate": str(Path(kvgate.__file__).parent),
            "procs": procs, "sessions": sessions, "handoff_s": handoff_s, "crowd_poll_s": CROWD_POLL_S, "levels": {}}


def run(url: str, procs: int, sessions: int, handoff_s: float, say=lambda s: None) -> dict:
    r = redis.Redis.from_url(url, **client_kw())
    out = header(r, procs, sessions, handoff_s)
    for w in levels(sessions):
        n = min(procs, w)
        say(f"{w} waiters in {n} processes")
        out["levels"][str(w)] = figures(run_crowd(r, url, f"scale-w{w}", w, handoff_s, procs=n), n)
    r.close()
    return out


def place_gates(rc: redis.RedisCluster, prefix: str, n: int) -> list[str]:
    """``n`` gate names, ``prefix-g<i>``, each its own hash tag, spread evenly over the
    cluster's primaries: a name is taken when its slot's node holds the fewest gates yet."""
    held = {addr: 0 for addr in server_nodes(rc)}
    names: list[str] = []
    i = 0
    while len(names) < n:
        name, i = f"{prefix}-g{i}", i + 1
        addr = node_of(rc, name)
        if held[addr] == min(held.values()):
            names.append(name)
            held[addr] += 1
    return names


def split(total: int, parts: int) -> list[int]:
    return [total * (i + 1) // parts - total * i // parts for i in range(parts)]


def run_cluster(url: str, gates: int, procs: int, sessions: int, handoff_s: float, say=lambda s: None) -> dict:
    rc = redis.RedisCluster.from_url(url, **client_kw())
    out = {**header(rc.get_redis_connection(rc.get_primaries()[0]), procs, sessions, handoff_s), "gates": gates,
           "nodes": sorted(server_nodes(rc))}
    for w in levels(sessions):
        names = place_gates(rc, f"scale-w{w}", gates)
        crowds = {name: (wg, min(pg, wg)) for name, wg, pg in zip(names, split(w, gates), split(procs, gates))}
        n = sum(p for _, p in crowds.values())
        say(f"{w} waiters on {gates} gates in {n} processes")
        m = run_crowds(rc, url, crowds, handoff_s)
        out["levels"][str(w)] = {
            "total": figures(m["total"], n),
            "gates": {name: {"node": node_of(rc, name), **figures(m["gates"][name], crowds[name][1])}
                      for name in names},
            "nodes": {addr: {"gates": v["gates"], "server_us_per_admission": v["server_us"],
                             "script_calls_per_admission": v["script_calls"],
                             "commands_per_admission": v["script_calls"] + v["inner_commands"]}
                      for addr, v in m["nodes"].items()},
        }
    rc.close()
    return out


HEAD = ["processes", "admissions/s", "wake p50 ms", "wake p99 ms", "server us/call", "server us/admission",
        "scripts/admission", "commands/admission", "re-check us", "not admitted"]


def cells(m: dict) -> list[str]:
    return [str(m["procs"]), f(m["admissions_per_s"], 0), f(m["wake_p50_ms"], 2), f(m["wake_p99_ms"], 2),
            f(m["server_us_per_call"]), f(m["server_us_per_admission"]), f(m["script_calls_per_admission"], 2),
            f(m["commands_per_admission"], 1), f(m["recheck_us"]), str(m["not_admitted"])]


def report(res: dict) -> str:
    where = (f"one place per gate handed from head to head for {res['handoff_s']:g} s per level; waiters re-check "
             f"every {res['crowd_poll_s']:g} s")
    head = f"redis-server {res['redis_version']}, kvgate from {res['kvgate']}; "
    if "gates" not in res:
        rows = [["waiters", *HEAD]] + [[f"{int(w):,}", *cells(m)] for w, m in res["levels"].items()]
        return "\n".join([head + "one gate, " + where, "", table(rows)])
    rows = [["waiters", "gate", "node", *HEAD]]
    nrows = [["waiters", "node", "gates", "server us/admission", "scripts/admission", "commands/admission"]]
    for w, lv in res["levels"].items():
        for name, m in lv["gates"].items():
            rows.append([f"{int(w):,}", name, m["node"], *cells(m)])
        rows.append([f"{int(w):,}", "all gates", "all nodes", *cells(lv["total"])])
        for addr, m in lv["nodes"].items():
            nrows.append([f"{int(w):,}", addr, str(len(m["gates"])), f(m["server_us_per_admission"]),
                          f(m["script_calls_per_admission"], 2), f(m["commands_per_admission"], 1)])
    return "\n".join([head + f"a {len(res['nodes'])}-node Redis Cluster, {res['gates']} gates, " + where, "",
                      table(rows), "", "per node (over the admissions of its gates)", table(nrows)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run: 4 processes, 10 and 100 waiters")
    ap.add_argument("--procs", type=int, help="client processes (default 64)")
    ap.add_argument("--sessions", type=int, help="waiting sessions at the largest level (default 10,000)")
    ap.add_argument("--handoff-s", type=float, help="seconds of hand-offs per level (default 6)")
    ap.add_argument("--cluster", action="store_true", help="on a private 3-node Redis Cluster, several gates")
    ap.add_argument("--gates", type=int, default=3, help="gates with --cluster (default 3)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    a = ap.parse_args(argv)
    prof = dict(PROFILES["quick" if a.quick else "full"])
    for k in ("procs", "sessions", "handoff_s"):
        if getattr(a, k) is not None:
            prof[k] = getattr(a, k)
    if prof["procs"] < 1 or prof["sessions"] < 1 or not prof["handoff_s"] > 0:
        ap.error("--procs and --sessions must be >= 1, --handoff-s > 0")
    if a.cluster and not 1 <= a.gates <= min(prof["procs"], levels(prof["sessions"])[0]):
        ap.error("--gates must be >= 1 and at most --procs and the smallest level's waiters")
    t0 = time.monotonic()

    def say(what: str) -> None:  # progress on stderr: the figures go to stdout alone
        print(f"[{time.monotonic() - t0:6.1f}s] {what}", file=sys.stderr, flush=True)

    if a.cluster:
        with embedded_cluster() as nodes:
            res = run_cluster(nodes[0].url, a.gates, prof["procs"], prof["sessions"], prof["handoff_s"], say)
    else:
        with embedded_redis("redis-server") as (url, _kind):
            res = run(url, prof["procs"], prof["sessions"], prof["handoff_s"], say)
    res["elapsed_s"] = time.monotonic() - t0
    print(json.dumps(res, indent=1) if a.json else report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
