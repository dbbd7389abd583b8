"""Memory soak: many short sessions through one gate, some clients killed with SIGKILL while
they hold leases; afterwards Redis must be back to its idle figures.

    python benchmarks/soak.py [--sessions 100000] [--procs 4] [--threads 8] [--kills 20] [--json]

Starts its own redis-server (kvgate.tools.bench's embedded one; the binary is required) and
one gate on it. ``--procs`` worker processes of ``--threads`` threads each run the sessions:
a session is one to three turns (``Gate.turn``) and ``finish_session``; the engine is sized
so that about half the threads' turns fit at once, so turns also wait in the FIFO. Meanwhile
``--kills`` doomed processes, one after another, each take turns (two held, a retried one
admitted, waiting or preempted) and are killed with SIGKILL: their leases must be reclaimed
by ``lease_ttl_s`` (short here), their waiters dropped by liveness, and their sessions'
preemption counts forgotten with them. A housekeeper stands in
for the poller (snapshot and ``housekeep`` every second) and a trainer drains the step
metrics every few seconds.

Before the run, the gate serves a few warm-up sessions, everything ends, and the idle figures
are taken: key count (DBSIZE), ``used_memory``, and each structure's size. Every few seconds
during the run the same figures are sampled. After the run, once the last reclaims are due
(bounded), they are taken again. The run fails (exit code 1, and the ``leaks`` list) when:

- a key or a structure (waiters, FIFO, liveness, leases, windows, session waiters,
  preemption counts) is left after the run, or the key count differs from idle;
- the gate's keys hold more than ``KEY_BYTES_TOLERANCE`` bytes more than idle (MEMORY USAGE),
  or ``used_memory`` differs from idle by more than ``MEMORY_TOLERANCE`` bytes (fixed
  allowances, not per session; the constants say what they allow for);
- the records alive at once ever exceeded what the clients' concurrency explains
  (``record_bound``): growth with the number of sessions;
- a pub/sub channel other than the gate's own, or subscribers left once the clients exited;
- a key outside ``kvgate:{soak}:``; a turn that raised, or that degraded (Redis was healthy).

``tests/test_soak.py`` runs this at a small size; docs/reliability.md has the 100,000-session
figures.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
if (_ROOT / "kvgate" / "__init__.py").is_file():
    sys.path.insert(0, str(_ROOT))

import redis  # noqa: E402

import kvgate  # noqa: E402
from kvgate.tools.bench.redis_embed import embedded_redis  # noqa: E402

from overhead import client_kw, config, engine, f, table  # noqa: E402  (benchmarks/overhead.py)

GATE = "soak"
#: turns: a prompt of PROMPT_MIN..PROMPT_MAX tokens and NEW_TOKENS new ones
PROMPT_MIN, PROMPT_MAX, NEW_TOKENS = 500, 3000, 100
#: short enough that a killed client's leases come back within the run's last seconds
KNOBS = dict(lease_ttl_s=2.0, idle_grace_s=0.5, wait_poll_s=0.5, max_wait_s=10.0, redis_timeout_s=5.0)
#: a difference of used_memory from idle this small is not a leak; fixed, not per session.
#: Redis's own buffers outside the keys (its clients', pub/sub's, the scripts' client) move
#: used_memory by up to ~100 KB either way between two quiet moments, whatever the run's
#: size (-100 KB to +82 KB after 1,000 sessions, +15 KB after 100,000); the gate's own keys
#: are checked apart, by bytes
MEMORY_TOLERANCE = 256 * 1024
#: a difference of the gate's keys' bytes (MEMORY USAGE) from idle this small is not a leak:
#: counters' longer digits, the totals' new fields
KEY_BYTES_TOLERANCE = 4 * 1024
#: the gate's structures whose size is counted: (key name, Redis type)
STRUCTURES = (("waiters", "hash"), ("fifo", "zset"), ("alive", "zset"), ("session_waiter", "hash"),
              ("leases", "hash"), ("lease_exp", "zset"), ("windows", "hash"), ("window_exp", "zset"),
              ("window_order", "zset"), ("preempted", "hash"), ("stats", "hash"), ("totals", "hash"))
#: the structures that hold one record per live turn, waiter or window (the rest are counters)
RECORDS = ("waiters", "fifo", "alive", "session_waiter", "leases", "lease_exp", "windows", "window_exp",
           "window_order", "preempted")
#: INFO memory's parts of used_memory, reported beside it
MEMORY_PARTS = ("used_memory_dataset", "used_memory_overhead", "used_memory_startup", "mem_clients_normal",
                "used_memory_scripts")
WARMUP_SESSIONS = 50
SAMPLE_EVERY_S = 2.0
DRAIN_EVERY_S = 5.0
#: bounds on the run's phases (a hang fails the run instead of stalling it)
DOOMED_READY_S = 60.0
SETTLE_S = 60.0


def gate_config() -> kvgate.GateConfig:
    return config(**KNOBS)


def capacity(threads_total: int) -> int:
    """An engine where about half the threads' turns fit at once (ceiling = capacity x 0.9)."""
    mean_need = (PROMPT_MIN + PROMPT_MAX) / 2 + NEW_TOKENS
    return int(max(1, threads_total // 2) * mean_need / 0.9)


# -- Redis's figures -------------------------------------------------------------------------
def figures(r: redis.Redis) -> dict:
    """Key count, memory, each structure's size, and pub/sub: what a leak would grow."""
    mem = r.info("memory")
    sizes = {}
    for name, kind in STRUCTURES:
        k = kvgate.keys.key(GATE, name)
        sizes[name] = r.hlen(k) if kind == "hash" else r.zcard(k)
    channel = kvgate.keys.channel(GATE)
    key_bytes = sum(r.memory_usage(k, samples=0) or 0 for k in r.scan_iter(match=kvgate.keys.key(GATE, "*")))
    return {"keys": r.dbsize(), "key_bytes": key_bytes, "used_memory": int(mem["used_memory"]),
            "memory": {k: int(mem[k]) for k in MEMORY_PARTS}, "sizes": sizes,
            "records": sum(sizes[n] for n in RECORDS),
            "channels": sorted(c.decode() for c in r.pubsub_channels()),
            "subscribers": int(dict(r.pubsub_numsub(channel)).get(channel.encode(), 0)),
            "clients": int(r.info("clients")["connected_clients"])}


def quiet_figures(r: redis.Redis) -> dict:
    """``figures`` for idle and after the run: Redis's slow log (its own bounded buffer, which
    a busy machine fills with a few entries or not) emptied first, so it is not read as ours."""
    r.slowlog_reset()
    return figures(r)


def foreign_keys(r: redis.Redis) -> list[str]:
    prefix = f"kvgate:{{{GATE}}}:"
    return sorted(k.decode() for k in r.scan_iter(count=1000) if not k.decode().startswith(prefix))


# -- the clients -----------------------------------------------------------------------------
def run_session(gate: kvgate.Gate, sid: str, rng: random.Random, tally: Counter) -> None:
    for _ in range(1 + rng.randrange(3)):
        with gate.turn(sid, prompt_tokens=rng.randint(PROMPT_MIN, PROMPT_MAX), max_new_tokens=NEW_TOKENS) as lease:
            tally[f"{lease.outcome}/{lease.reason}"] += 1
    gate.finish_session(sid)
    tally["sessions"] += 1


def worker(url: str, idx: int, threads: int, next_session: Any, total: int, out: Any) -> None:
    """One client process: ``threads`` threads take session numbers until ``total``."""
    gate = kvgate.Gate.from_url(url, gate=GATE, config=gate_config())
    tallies = [Counter() for _ in range(threads)]

    def loop(k: int) -> None:
        rng = random.Random(idx * 1000 + k)
        while True:
            with next_session.get_lock():
                n = next_session.value
                if n >= total:
                    return
                next_session.value = n + 1
            try:
                run_session(gate, f"s{n}", rng, tallies[k])
            except Exception as e:  # noqa: BLE001 - counted: a soak must see every failure
                tallies[k][f"raised/{type(e).__name__}"] += 1

    ts = [threading.Thread(target=loop, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    gate.close()
    out.put(dict(sum(tallies, Counter())))


def doomed(url: str, idx: int, ready: Any) -> None:
    """A client killed mid-lease: it says it is ready once two of its turns are admitted and
    held; a third session's turn is tried twice (a retry: when the first attempt is still
    waiting, the second preempts it, and the session's preemption count is left for the
    reclaim to end, as no finish_session will come). The parent then kills it with SIGKILL."""
    gate = kvgate.Gate.from_url(url, gate=GATE, config=gate_config())
    admitted = []
    lock = threading.Lock()

    def take(sid: str) -> None:
        try:
            lease = gate.acquire(sid, prompt_tokens=PROMPT_MAX, max_new_tokens=NEW_TOKENS)
        except kvgate.Preempted:
            return
        with lock:
            admitted.append(lease.admitted)
            if admitted.count(True) == 2 and len(admitted) == 2 + admitted.count(False):
                ready.send(idx)  # once: when the second admission comes
    for sid in (f"dead{idx}-0", f"dead{idx}-1", f"dead{idx}-2", f"dead{idx}-2"):
        threading.Thread(target=take, args=(sid,), daemon=True).start()
        time.sleep(0.05)
    time.sleep(3600)


# -- the run ---------------------------------------------------------------------------------
class Housekeeper(threading.Thread):
    """The poller's part (a fresh snapshot, ``housekeep``) every second, a trainer's (drain the
    step metrics) every ``DRAIN_EVERY_S``, and the samples of Redis's figures."""

    def __init__(self, url: str, cap: int):
        super().__init__(daemon=True)
        self.gate = kvgate.Gate.from_url(url, gate=GATE, config=gate_config())
        self.r = redis.Redis.from_url(url, **client_kw())
        self.cap = cap
        self.stop = threading.Event()
        self.samples: list[dict] = []

    def run(self) -> None:
        t0 = last_sample = last_drain = time.monotonic()
        while not self.stop.wait(1.0):
            self.gate.write_snapshot(engine(self.cap))
            self.gate.housekeep(100)
            now = time.monotonic()
            if now - last_drain >= DRAIN_EVERY_S:
                self.gate.step_metrics()
                last_drain = now
            if now - last_sample >= SAMPLE_EVERY_S:
                self.samples.append({"t": round(now - t0, 1), **figures(self.r)})
                last_sample = now
        # its connections go before the figures after the run: a client's buffers are memory
        self.gate.close()
        self.r.close()


def settle(gate: kvgate.Gate, r: redis.Redis) -> float:
    """Housekeep until every record is gone (the killed clients' leases past their TTL, their
    windows past the grace, their waiters past liveness); seconds it took (bounded)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < SETTLE_S:
        gate.housekeep(1000)
        if figures(r)["records"] == 0:
            break
        time.sleep(0.2)
    return time.monotonic() - t0


def record_bound(threads_total: int, kills: int) -> int:
    """The most records the clients' concurrency explains, whatever the number of sessions:
    per live turn a waiter (waiters, fifo, alive, session_waiter) or a lease (leases,
    lease_exp) and its session's window (windows, window_exp, window_order); per killed client
    three such turns, alive until reclaimed (they may overlap the next ones)."""
    return 8 * (threads_total + 3 * kills)


def soak(url: str, sessions: int, procs: int, threads: int, kills: int) -> dict:
    r = redis.Redis.from_url(url, **client_kw())
    cap = capacity(procs * threads)
    gate = kvgate.Gate.from_url(url, gate=GATE, config=gate_config())
    gate.write_snapshot(engine(cap))
    warm, rng = Counter(), random.Random(0)
    for i in range(WARMUP_SESSIONS):
        run_session(gate, f"warm{i}", rng, warm)
    settle(gate, r)
    gate.step_metrics()
    idle = quiet_figures(r)

    ctx = multiprocessing.get_context("spawn")
    next_session = ctx.Value("q", 0)
    out = ctx.Queue()
    keeper = Housekeeper(url, cap)
    keeper.start()
    t0 = time.monotonic()
    workers = [ctx.Process(target=worker, args=(url, i, threads, next_session, sessions, out)) for i in range(procs)]
    for p in workers:
        p.start()
    killed = 0
    for k in range(kills):
        # spread over the run: the next doomed client once its share of the sessions is done
        while next_session.value < sessions * (k + 1) // (kills + 1) and any(p.is_alive() for p in workers):
            time.sleep(0.1)
        # a pipe of its own: a process killed while it writes to a shared queue can leave the
        # queue's lock held for every later writer
        ready, child_end = ctx.Pipe(duplex=False)
        p = ctx.Process(target=doomed, args=(url, k, child_end), daemon=True)
        p.start()
        ready.poll(DOOMED_READY_S)  # (if it never held two leases, it is killed all the same)
        os.kill(p.pid, signal.SIGKILL)
        p.join(timeout=10)
        killed += 1
    tally: Counter = Counter()
    for _ in workers:
        tally.update(out.get())
    for p in workers:
        p.join(timeout=60)
    elapsed = time.monotonic() - t0
    keeper.stop.set()
    keeper.join(timeout=30)
    settle_s = settle(gate, r)
    gate.step_metrics()  # the trainer's last drain
    end = quiet_figures(r)
    totals = {k.decode(): int(float(v)) for k, v in r.hgetall(kvgate.keys.key(GATE, "totals")).items()}
    peak = max(keeper.samples, key=lambda s: s["records"], default=end)
    res = {
        "redis_version": r.info("server")["redis_version"], "kvgate": str(Path(kvgate.__file__).parent),
        "sessions": sessions, "procs": procs, "threads": threads, "kills": killed, "elapsed_s": elapsed,
        "sessions_per_s": sessions / elapsed, "settle_s": settle_s, "outcomes": dict(sorted(tally.items())),
        "totals": {k: totals.get(k, 0) for k in ("admit", "wait", "preempted", "lease_expired", "dead_waiter",
                                                 "window_expired", "session_finished")},
        "idle": idle, "end": end, "peak_records": peak["records"], "record_bound": record_bound(procs * threads, kills),
        "peak_used_memory": max([s["used_memory"] for s in keeper.samples] + [end["used_memory"]]),
        "samples": keeper.samples, "foreign_keys": foreign_keys(r),
    }
    res["leaks"] = leaks(res)
    gate.close()
    r.close()
    return res


def leaks(res: dict) -> list[str]:
    idle, end = res["idle"], res["end"]
    out = []
    if end["keys"] != idle["keys"]:
        out.append(f"key count {end['keys']} after the run, {idle['keys']} idle")
    left = {k: v for k, v in end["sizes"].items() if k in RECORDS and v}
    if left:
        out.append(f"records left after the run: {left}")
    grew = end["key_bytes"] - idle["key_bytes"]
    if abs(grew) > KEY_BYTES_TOLERANCE:
        out.append(f"the gate's keys hold {grew:+,} bytes more than idle (tolerance {KEY_BYTES_TOLERANCE:,})")
    grew = end["used_memory"] - idle["used_memory"]
    if abs(grew) > MEMORY_TOLERANCE:
        out.append(f"used_memory {grew:+,} bytes from idle (tolerance {MEMORY_TOLERANCE:,})")
    if res["peak_records"] > res["record_bound"]:
        out.append(f"{res['peak_records']} records alive at once, more than the clients explain "
                   f"({res['record_bound']})")
    channel = kvgate.keys.channel(GATE)
    if set(end["channels"]) - {channel}:
        out.append(f"pub/sub channels other than the gate's: {end['channels']}")
    if end["subscribers"]:
        out.append(f"{end['subscribers']} subscribers left on {channel} after every client exited")
    if res["foreign_keys"]:
        out.append(f"keys outside the gate's namespace: {res['foreign_keys'][:5]}")
    bad = {k: v for k, v in res["outcomes"].items() if k.startswith("raised/") or k == "bypass/degraded"}
    if bad:
        out.append(f"turns that raised or degraded with Redis healthy: {bad}")
    if res["outcomes"].get("sessions", 0) != res["sessions"]:
        out.append(f"{res['outcomes'].get('sessions', 0)} sessions finished of {res['sessions']}")
    return out


def report(res: dict) -> str:
    idle, end = res["idle"], res["end"]
    rows = [["figure", "idle", "after the run", "peak during it"],
            ["keys (DBSIZE)", str(idle["keys"]), str(end["keys"]), str(max(s["keys"] for s in res["samples"]) if res["samples"] else "-")],
            ["used_memory (bytes)", f(idle["used_memory"], 0), f(end["used_memory"], 0), f(res["peak_used_memory"], 0)],
            ["the gate's keys (bytes, MEMORY USAGE)", f(idle["key_bytes"], 0), f(end["key_bytes"], 0),
             f(max(s["key_bytes"] for s in res["samples"]), 0) if res["samples"] else "-"],
            ["records (waiters, leases, windows, ...)", str(idle["records"]), str(end["records"]),
             f"{res['peak_records']} (bound {res['record_bound']})"],
            ["stats / totals fields", f"{idle['sizes']['stats']} / {idle['sizes']['totals']}",
             f"{end['sizes']['stats']} / {end['sizes']['totals']}", "-"],
            ["pub/sub channels, subscribers", f"{len(idle['channels'])}, {idle['subscribers']}",
             f"{len(end['channels'])}, {end['subscribers']}", "-"],
            ["connected clients", str(idle["clients"]), str(end["clients"]), "-"]]
    lines = [f"redis-server {res['redis_version']}, kvgate from {res['kvgate']}",
             f"{res['sessions']:,} sessions from {res['procs']} processes x {res['threads']} threads, "
             f"{res['kills']} clients killed with SIGKILL holding leases: {res['elapsed_s']:.0f} s "
             f"({res['sessions_per_s']:,.0f} sessions/s); the last reclaims took {res['settle_s']:.1f} s after",
             "turns: " + ", ".join(f"{k}={v:,}" for k, v in res["outcomes"].items()),
             "totals: " + ", ".join(f"{k}={v:,}" for k, v in res["totals"].items()),
             "", table(rows), "",
             "leaks: " + ("none" if not res["leaks"] else "; ".join(res["leaks"]))]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=100_000)
    ap.add_argument("--procs", type=int, default=4, help="client processes")
    ap.add_argument("--threads", type=int, default=8, help="threads per client process")
    ap.add_argument("--kills", type=int, default=20, help="clients killed with SIGKILL while they hold leases")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    a = ap.parse_args(argv)
    if min(a.sessions, a.procs, a.threads) < 1 or a.kills < 0:
        ap.error("--sessions, --procs and --threads must be >= 1, --kills >= 0")
    with embedded_redis("redis-server") as (url, _kind):
        res = soak(url, a.sessions, a.procs, a.threads, a.kills)
    print(json.dumps(res, indent=1) if a.json else report(res))
    return 1 if res["leaks"] else 0


if __name__ == "__main__":
    sys.exit(main())
