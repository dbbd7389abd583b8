"""What a kvgate turn costs Redis, beside the cheapest things a client can ask of it.

    python benchmarks/overhead.py [--quick] [--json] [--rounds N]

Starts its own redis-server (kvgate.tools.bench's embedded one; the binary is required:
fakeredis would measure fakeredis) and measures, in one run, four subjects side by side:

- ``kvgate``: one turn, ``Gate.acquire`` + ``Lease.release`` of a 5,000-token prompt (50 new
  tokens) on a gate with a fresh snapshot and room to spare, so every turn is admitted at once
  (the gate's floor: not degraded, not waiting). Sessions repeat, as an agent's do: after its
  first turn a session enters through its ownership window (reason ``reserved_session``).
- ``kvgate-eval``: the same turn on a gate that calls the scripts' EVAL form (a server without
  functions), beside the function library the ``kvgate`` subject calls (kvgate/client/scripts.py).
- ``lock``: redis-py ``Lock`` acquire (SET NX PX) + release (a two-command script).
- ``ping``: two bare PINGs (two round trips that do no work: the wire's floor).

Each is measured from one sync client, and all but ``kvgate-eval`` from one asyncio loop
(``AsyncGate``, redis.asyncio) with 1, 16, 64 and 256 concurrent callers. Rounds interleave
the subjects (their order rotates each round), and the table shows each figure's median over
the rounds. Per subject: p50 / p99
latency of one operation, operations per second, and from ``INFO commandstats`` (reset with
``CONFIG RESETSTAT`` before each block): the server's microseconds per operation (the
commands the client sent; a script's time includes the commands it runs), the script calls
per operation (FCALL, or EVALSHA) and the Redis commands run inside scripts per operation.

A breakdown pass then splits a sync turn script by script (acquire, release): server
microseconds, inner commands by name, and what a call of a kvgate script costs before its
body runs: an EVALSHA of ``return 1`` with the same KEYS and ARGV; one that defines the shared
helpers (``lua/includes``) every EVAL script starts with and runs an empty body as every call
runs its body (``run``: the call's keys, clock and parameters set up); and an FCALL of that
empty body in a library of those helpers: the EVAL form's and the function form's fixed cost.
Beside them, a turn's floor: the least work a session's turn through its window can do in any
layout of the gate's keys (``FLOOR_LIBRARY``: one record per session, 15 commands in two calls),
so the breakdown says how far below today's turn any redesign could go.

A client-side pass splits a sync turn's time in the client: the part inside the gate's
redis-py calls (the wire, redis-py and the server) and the rest, kvgate's own Python, beside
two FCALLs of a function that returns at once with a turn's KEYS and ARGV.

Last, the same gate with 10, 1,000 and 10,000 waiters queued (an asyncio crowd in a child
process, stopped by pid): one lease fills the gate's ceiling, the waiters wait in its FIFO,
and each admitted waiter releases at once and queues again, so the FIFO stays as long while
the gate hands its one place from head to head. Per level: the wake-up latency from a release
to the next head's admission (p50 / p99), hand-offs per second, and per hand-off the server
microseconds, script calls and inner commands, with each script's server microseconds per
call (from SLOWLOG, which records every call during that phase). The crowd re-checks every
``CROWD_POLL_S`` (see there why not the default ``wait_poll_s``), so its few re-checks do not
show in a hand-off's figures; what one re-check costs the server is measured apart, on
waiters spread along the FIFO: the queue's own load is that times waiters / ``wait_poll_s``.

The same hand-offs are then made by this process alone, one call after another, on a queue it
builds itself (``quiet_handoffs``): with no crowd sharing the machine's cores, the server's
figures per hand-off show its work against the queue's length, where the crowd's own CPU
would otherwise inflate the server's time per call on a small machine.

``--quick`` is a smoke run (fewer operations and rounds, 10 and 100 waiters); ``--json``
prints the figures as JSON instead of tables.

This script is over 400 lines on purpose: its four measurements share one Redis, one way of
reading the server's counters and one report, and benchmarks/scale.py imports its waiters'
crowd (``run_crowd``, and ``run_crowds`` for several gates at once on one Redis or a Redis
Cluster) rather than keeping a second copy.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import statistics
import sys
import time
from collections import Counter, deque
from pathlib import Path
from typing import Any, Awaitable, Callable

# run from a checkout, measure that checkout's kvgate (the script's own directory comes first on
# sys.path, not the working directory, so an installed kvgate elsewhere would win otherwise)
_ROOT = Path(__file__).resolve().parents[1]
if (_ROOT / "kvgate" / "__init__.py").is_file():
    sys.path.insert(0, str(_ROOT))

import redis  # noqa: E402
import redis.asyncio as aioredis  # noqa: E402
from redis.backoff import NoBackoff  # noqa: E402
from redis.asyncio.retry import Retry as AsyncRetry  # noqa: E402
from redis.retry import Retry  # noqa: E402

import kvgate  # noqa: E402
from kvgate import keys as kvkeys  # noqa: E402
from kvgate.client.scripts import SCRIPT_NAMES, lua_dir, render  # noqa: E402
from kvgate.tools.bench.redis_embed import embedded_redis  # noqa: E402

PROMPT = 5000
NEW_TOKENS = 50
#: the sessions the sync subjects cycle over (each agent session takes many turns)
SESSIONS = 20
#: a snapshot this large admits every turn of every concurrency level at once
ROOMY_TOKENS = 100_000_000
#: the snapshot is written once per gate: no poller runs, so it must stay fresh all run
STALENESS_S = 3600.0
CONCURRENCY = (1, 16, 64, 256)
WAITERS = (10, 1_000, 10_000)
#: the commands a client sends itself; every other command in commandstats ran in a script
#: a script call: kvgate's function library (FCALL), or an EVAL script (kvgate's EVAL form, the Lock's)
SCRIPT_CALLS = {"fcall", "evalsha", "eval"}
#: what a kvgate gate sends, in either form of its scripts
KVGATE_COMMANDS = SCRIPT_CALLS | {"script|load", "function|load"}
CLIENT_COMMANDS = {"kvgate": KVGATE_COMMANDS, "kvgate-eval": KVGATE_COMMANDS,
                   "lock": {"set", "evalsha", "eval", "script|load"},
                   "ping": {"ping"}}
#: commands of the benchmark's own bookkeeping, never counted
OWN_COMMANDS = {"config|resetstat", "config|set", "info", "slowlog|get", "slowlog|reset", "client|setinfo"}
#: bounds on the waiters phase (a hang fails the run instead of stalling it)
CROWD_START_S = 300.0
CROWD_RESULT_S = 120.0
#: re-checks timed per waiters level (spread along the FIFO)
RECHECKS = 50
#: hand-offs of the quiet pass per waiters level (quiet_handoffs)
QUIET_HANDOFFS = 300
#: the crowd queues this many waiters at a time
CROWD_BATCH = 500
#: a crowd process's connections (more callers wait for one); on a cluster, where redis-py
#: refuses a call beyond a node's connections, CROWD_BATCH per node, and half a batch queues
#: at a time, so the re-checks of waiters queued earlier find a connection too
CROWD_CONNECTIONS = 64
#: the crowd's re-check poll. Each waiter re-checks once per poll: at the default 5 s, 10,000
#: waiters are 2,000 acquire calls a second, more than one Python process on a shared 2-core
#: machine can drive (its calls pass the gate's deadline and degrade), so the crowd polls every
#: 30 s and the table reports the re-checks' cost per call, which scales as waiters / poll
CROWD_POLL_S = 30.0

PROFILES = {
    "full": dict(rounds=5, sync_ops=1000, async_ops=1000, breakdown_turns=300, waiters=WAITERS,
                 handoff_s=6.0),
    "quick": dict(rounds=2, sync_ops=100, async_ops=100, breakdown_turns=30, waiters=(10, 100),
                  handoff_s=1.5),
}


# -- Redis bookkeeping -----------------------------------------------------------------------
def command_stats(r: redis.Redis) -> dict[str, dict]:
    """INFO commandstats as {command: {calls, usec}}, the benchmark's own commands left out."""
    out = {}
    for k, v in r.info("commandstats").items():
        name = k.removeprefix("cmdstat_")
        if name not in OWN_COMMANDS:
            out[name] = {"calls": int(v["calls"]), "usec": int(v["usec"])}
    return out


def per_op(stats: dict[str, dict], client: set[str], n: int) -> dict:
    """One block's server figures per operation: microseconds of the commands the client sent
    (a script's own time includes the commands it runs, so those are not added again), script
    calls, and the commands that ran inside scripts."""
    sent_us = sum(v["usec"] for k, v in stats.items() if k in client)
    inner = {k: v for k, v in stats.items() if k not in client}
    scripts = sum(v["calls"] for k, v in stats.items() if k in SCRIPT_CALLS)
    return {"server_us": sent_us / n, "script_calls": scripts / n,
            "inner_commands": sum(v["calls"] for v in inner.values()) / n,
            "inner_us": sum(v["usec"] for v in inner.values()) / n}


def server_nodes(r: Any) -> dict[str, redis.Redis]:
    """The servers whose counters a run reads, by ``host:port``: a cluster client's primaries
    (INFO, CONFIG and SLOWLOG are per node), else the one server of ``r``."""
    if isinstance(r, redis.RedisCluster):
        return {n.name: r.get_redis_connection(n) for n in r.get_primaries()}
    kw = r.connection_pool.connection_kwargs
    return {f"{kw.get('host', 'localhost')}:{kw.get('port', 6379)}": r}


def node_of(r: Any, gate_name: str) -> str:
    """The ``host:port`` (a key of server_nodes) that holds gate ``gate_name``'s hash slot."""
    if isinstance(r, redis.RedisCluster):
        return r.get_node_from_key(kvkeys.key(gate_name, "ledger")).name
    return next(iter(server_nodes(r)))


def quantile(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")


def block_figures(lat: list[float], elapsed: float, stats: dict, client: set[str]) -> dict:
    return {"p50_ms": quantile(lat, 0.5) * 1000, "p99_ms": quantile(lat, 0.99) * 1000,
            "ops_per_s": len(lat) / elapsed, **per_op(stats, client, len(lat))}


def medians(blocks: list[dict]) -> dict:
    """Each figure's median over the rounds."""
    return {k: statistics.median(b[k] for b in blocks) for k in blocks[0]}


def config(**kw: Any) -> kvgate.GateConfig:
    return kvgate.GateConfig(admission=True, residency=True, staleness_s=STALENESS_S, **kw)


def engine(capacity: int) -> list[kvgate.EngineState]:
    return [kvgate.EngineState(engine_id="e", capacity_tokens=capacity, usage=0.1, url="http://127.0.0.1:9",
                               kind="sglang")]


def acquire_params(ticket: str, session: str, *, need: int = PROMPT + NEW_TOKENS, prompt: int = PROMPT,
                   retain: int = 0) -> dict:
    """acquire.lua's parameters for a measured turn: not protected, no probe configured."""
    return dict(ticket=ticket, session=session, need=need, prompt=prompt, protected=0, retain=retain, probe=-2)


def acquire_argv(gate: kvgate.Gate) -> list:
    """A turn's acquire ARGV on ``gate`` (the clock, its parameters, the gate's knobs), for the
    calls that measure what a script call costs before its body runs."""
    return list(gate._flows.eval_op("acquire", acquire_params("t", "s", retain=1)).argv)


def client_kw(retry: type = Retry) -> dict:
    # what Gate.from_url builds: a bounded call, no retries (the gate's own breaker decides);
    # an asyncio client takes redis.asyncio's Retry (redis-py warns and converts a sync one)
    return dict(socket_timeout=5.0, socket_connect_timeout=5.0, retry=retry(NoBackoff(), 0))


# -- one sync client ------------------------------------------------------------------------
def turn_on(g: kvgate.Gate) -> Callable[[int], None]:
    """The measured turn on gate ``g``: turn ``i`` is session ``i % SESSIONS``'s acquire and
    release (benchmarks/lua_profile.py profiles the same turn)."""
    ids = list(range(3, 3 + PROMPT))

    def turn(i: int) -> None:
        lease = g.acquire(f"s{i % SESSIONS}", prompt_ids=ids, max_new_tokens=NEW_TOKENS)
        if not lease.admitted:
            raise RuntimeError(f"an uncontended turn was not admitted: {lease!r}")
        lease.release()
    return turn


def sync_subjects(r: redis.Redis, gate: kvgate.Gate, eval_gate: kvgate.Gate) -> dict[str, Callable[[int], Any]]:
    def lock(i: int) -> None:
        lk = r.lock(f"bench:lock:{i % SESSIONS}", timeout=10)
        if not lk.acquire(blocking=False):
            raise RuntimeError("an uncontended lock was not acquired")
        lk.release()

    def ping(i: int) -> None:
        r.ping()
        r.ping()

    return {"kvgate": turn_on(gate), "kvgate-eval": turn_on(eval_gate), "lock": lock, "ping": ping}


def eval_form(gate: kvgate.Gate) -> kvgate.Gate:
    """``gate`` calling the scripts' EVAL form, as on a server without functions
    (kvgate/client/scripts.py ScriptCaller)."""
    gate._caller.use_functions = False
    return gate


def run_sync(url: str, rounds: int, ops: int) -> dict:
    r = redis.Redis.from_url(url, **client_kw())
    gate = kvgate.Gate(r, gate="overhead-sync", config=config())
    gate.write_snapshot(engine(ROOMY_TOKENS))
    eval_gate = eval_form(kvgate.Gate(r, gate="overhead-sync-eval", config=config()))
    eval_gate.write_snapshot(engine(ROOMY_TOKENS))
    subjects = sync_subjects(r, gate, eval_gate)
    for fn in subjects.values():  # warm-up: scripts loaded, connection made, sessions' windows open
        for i in range(2 * SESSIONS):
            fn(i)
    blocks: dict[str, list[dict]] = {k: [] for k in subjects}
    names = list(subjects)
    for rnd in range(rounds):
        for name in names[rnd % len(names):] + names[:rnd % len(names)]:
            fn, lat = subjects[name], []
            r.config_resetstat()
            t0 = time.perf_counter()
            for i in range(ops):
                a = time.perf_counter()
                fn(i)
                lat.append(time.perf_counter() - a)
            elapsed = time.perf_counter() - t0
            blocks[name].append(block_figures(lat, elapsed, command_stats(r), CLIENT_COMMANDS[name]))
    gate.close()
    eval_gate.close()
    r.close()
    return {k: medians(v) for k, v in blocks.items()}


# -- one asyncio loop ------------------------------------------------------------------------
def async_client(url: str, connections: int) -> aioredis.Redis:
    """An asyncio client whose callers beyond ``connections`` wait for a connection (redis-py's
    default pool refuses them with MaxConnectionsError, which the gate takes for a fault)."""
    pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=connections, timeout=30,
                                                    **client_kw(AsyncRetry))
    return aioredis.Redis(connection_pool=pool)


async def async_blocks(url: str, rounds: int, ops: int) -> dict:
    r = async_client(url, max(CONCURRENCY))  # a connection per caller: none waits for the pool
    stat = redis.Redis.from_url(url, **client_kw())  # bookkeeping off the measured loop's client
    gate = kvgate.AsyncGate(r, gate="overhead-async", config=config())
    await gate.write_snapshot(engine(ROOMY_TOKENS))
    ids = list(range(3, 3 + PROMPT))

    async def turn(worker: int) -> None:
        lease = await gate.acquire(f"c{worker}", prompt_ids=ids, max_new_tokens=NEW_TOKENS)
        if not lease.admitted:
            raise RuntimeError(f"an uncontended turn was not admitted: {lease!r}")
        await lease.release()

    async def lock(worker: int) -> None:
        lk = r.lock(f"bench:alock:{worker}", timeout=10)
        if not await lk.acquire(blocking=False):
            raise RuntimeError("an uncontended lock was not acquired")
        await lk.release()

    async def ping(worker: int) -> None:
        await r.ping()
        await r.ping()

    subjects: dict[str, Callable[[int], Awaitable]] = {"kvgate": turn, "lock": lock, "ping": ping}

    async def block(fn: Callable[[int], Awaitable], conc: int, n: int) -> tuple[list[float], float]:
        lat: list[float] = []
        left = [n]

        async def worker(w: int) -> None:
            while left[0] > 0:
                left[0] -= 1
                a = time.perf_counter()
                await fn(w)
                lat.append(time.perf_counter() - a)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(conc)))
        return lat, time.perf_counter() - t0

    for fn in subjects.values():  # warm-up: connections for the largest level, sessions' windows open
        await block(fn, max(CONCURRENCY), 2 * max(CONCURRENCY))
    blocks: dict[tuple[str, int], list[dict]] = {}
    names = list(subjects)
    for rnd in range(rounds):
        for conc in CONCURRENCY:
            for name in names[rnd % len(names):] + names[:rnd % len(names)]:
                n = max(ops, 8 * conc)  # every caller runs several operations at every level
                stat.config_resetstat()
                lat, elapsed = await block(subjects[name], conc, n)
                blocks.setdefault((name, conc), []).append(
                    block_figures(lat, elapsed, command_stats(stat), CLIENT_COMMANDS[name]))
    await gate.aclose()
    await r.aclose()
    stat.close()
    return {name: {str(c): medians(blocks[(name, c)]) for c in CONCURRENCY} for name in names}


# -- script by script ------------------------------------------------------------------------
def script_breakdown(url: str, turns: int) -> dict:
    """A sync turn split by script, by INFO commandstats between the two calls, and the cost
    of calling a kvgate script before its body runs."""
    r = redis.Redis.from_url(url, **client_kw())
    gate = kvgate.Gate(r, gate="overhead-split", config=config())
    gate.write_snapshot(engine(ROOMY_TOKENS))
    ids = list(range(3, 3 + PROMPT))
    per: dict[str, Counter] = {"acquire": Counter(), "release": Counter()}
    us: dict[str, list[float]] = {"acquire": [], "release": []}
    inner_us: Counter = Counter()
    reasons: Counter = Counter()
    for i in range(SESSIONS + turns):
        measured = i >= SESSIONS  # the sessions' first turns open their windows: not measured
        if measured:
            r.config_resetstat()
        lease = gate.acquire(f"s{i % SESSIONS}", prompt_ids=ids, max_new_tokens=NEW_TOKENS)
        if measured:
            a = command_stats(r)
            r.config_resetstat()
        lease.release()
        if measured:
            b = command_stats(r)
            reasons[lease.reason] += 1
            for name, st in (("acquire", a), ("release", b)):
                us[name].append(sum(v["usec"] for k, v in st.items() if k in SCRIPT_CALLS))
                for k, v in st.items():
                    if k not in SCRIPT_CALLS:
                        per[name][k] += v["calls"]
                        inner_us[name] += v["usec"]
    out: dict[str, Any] = {"turns": turns, "reasons": dict(reasons)}
    for name in per:
        out[name] = {"server_us": statistics.median(us[name]),
                     "inner_commands": sum(per[name].values()) / turns, "inner_us": inner_us[name] / turns,
                     "by_command": {k: round(v / turns, 2)
                                    for k, v in sorted(per[name].items(), key=lambda kv: -kv[1])}}
    # the fixed cost of a kvgate script call: its KEYS and ARGV, then the shared helpers
    # (an acquire's ARGV: the clock, a turn's parameters, the gate's knobs)
    argv = acquire_argv(gate)
    includes = "".join(f"--@include {n}\n" for n in ("common", "snapshot", "windows", "leases", "waiters"))
    base = lua_dir()
    shared = render(includes, lambda n: (base / "includes" / f"{n}.lua").read_text())
    # an empty body run as every call runs its body (``run``: the call's keys, clock and
    # parameters set up first), in each form
    helpers = shared + "\nreturn run(KEYS, ARGV, function() return 1 end)\n"

    def call_us(src: str) -> float:
        s = r.register_script(src)
        s(keys=gate._keys, args=argv)
        r.config_resetstat()
        for _ in range(turns):
            s(keys=gate._keys, args=argv)
        return command_stats(r)["evalsha"]["usec"] / turns

    for name, src in (("return_1", "return 1"), ("helpers_only", helpers)):
        out[name] = {"server_us": call_us(src)}
    # the same in the function form: the helpers load once with the library
    r.function_load("#!lua name=kvgate_overhead_probe\n" + shared
                    + "\nredis.register_function('kvgate_overhead_empty', function(keys, argv) "
                      "return run(keys, argv, function() return 1 end) end)\n", replace=True)
    r.config_resetstat()
    for _ in range(turns):
        r.fcall("kvgate_overhead_empty", len(gate._keys), *gate._keys, *argv)
    out["function_empty"] = {"server_us": command_stats(r)["fcall"]["usec"] / turns}
    r.function_delete("kvgate_overhead_probe")
    out["floor"] = floor_turn(r, gate, turns)
    # what one step of a script's work costs inside it: UNIT_REPEAT of it in one call, less
    # the empty call, per step (the record is the session's window as the turns above left it)
    record = r.hvals(gate.key("windows"))[0].decode()
    out["units_us"] = {name: max(0.0, call_us(f"for _ = 1, {UNIT_REPEAT} do {body} end return 1")
                                 - out["return_1"]["server_us"]) / UNIT_REPEAT
                       for name, body in unit_steps(record).items()}
    gate.close()
    r.close()
    return out


def client_split(url: str, rounds: int, ops: int) -> dict:
    """Where a sync turn's time goes on the client's side: the whole turn, the part inside the
    gate's redis-py calls (the wire, redis-py and the server), and what is left, kvgate's own
    Python (its flows and drivers); beside two FCALLs of a function that returns at once, with a
    turn's KEYS and ARGV (the wire's and redis-py's floor for two script calls). Blocks of each
    alternate; medians over the rounds."""
    r = redis.Redis.from_url(url, **client_kw())
    gate = kvgate.Gate(r, gate="overhead-client", config=config())
    gate.write_snapshot(engine(ROOMY_TOKENS))
    turn = turn_on(gate)
    in_calls = [0.0]
    send = gate._send_commands

    def timed_send(op: Any, *a: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return send(op, *a, **kw)
        finally:
            in_calls[0] += time.perf_counter() - t

    gate._send_commands = timed_send  # type: ignore[method-assign]
    argv = acquire_argv(gate)
    r.function_load("#!lua name=kvgate_overhead_client\nredis.register_function("
                    "'kvgate_overhead_return', function(keys, argv) return '{}' end)\n", replace=True)

    def pair(i: int) -> None:
        for _ in range(2):
            r.fcall("kvgate_overhead_return", len(gate._keys), *gate._keys, *argv)

    for i in range(2 * SESSIONS):  # warm-up: the sessions' windows open
        turn(i)
    rows: dict[str, list[float]] = {"turn_us": [], "in_redis_py_us": [], "kvgate_python_us": [], "bare_pair_us": []}
    for _ in range(rounds):
        in_calls[0] = 0.0
        t0 = time.perf_counter()
        for i in range(ops):
            turn(i)
        whole = (time.perf_counter() - t0) / ops * 1e6
        t0 = time.perf_counter()
        for i in range(ops):
            pair(i)
        rows["bare_pair_us"].append((time.perf_counter() - t0) / ops * 1e6)
        rows["turn_us"].append(whole)
        rows["in_redis_py_us"].append(in_calls[0] / ops * 1e6)
        rows["kvgate_python_us"].append(whole - in_calls[0] / ops * 1e6)
    r.function_delete("kvgate_overhead_client")
    gate.close()
    r.close()
    return {k: statistics.median(v) for k, v in rows.items()}


#: how many times a unit step runs in the call that measures it
UNIT_REPEAT = 20

#: The least work a turn of a session re-entering its own window can do in any layout of the
#: gate's keys, as a function library of two calls (one record per session, holding its
#: window and its lease; nobody waiting). Every line is a step the rules need: the one clock
#: (SPEC 8), the turn's parameters, the session's record, the snapshot's freshness and ceiling
#: (rule 3), whether anyone waits (rule 6's order, and the time integrals the budget reads),
#: the lease's TTL deadline (a dead holder's lease is reclaimed), the ledger following the
#: window's charge, one counter, the reply. Left out, so the figure is a lower bound: the
#: epoch, the gate's progress for aging, the re-prefill and tool-gap signals, the reaps'
#: deadline check, the trim's and the advance's checks.
FLOOR_LIBRARY = """#!lua name=kvgate_overhead_floor
local function now_ms()
  local t = redis.call("TIME")
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
redis.register_function('kvgate_floor_acquire', function(keys, argv)
  local now = now_ms()
  local p = cjson.decode(argv[2])
  local raw = redis.call("HGET", keys[1], p.session)
  local rec = raw and cjson.decode(raw) or { t = 0, h = 0 }
  local snap = redis.call("HMGET", keys[2], "ts_ms", "n_healthy", "capacity", "budget_scale", "budget_ts_ms", "usage")
  local waiting = redis.call("ZCARD", keys[3])
  local grew = p.need - rec.t
  rec.t, rec.h, rec.k, rec.a = p.need, 1, p.ticket, now
  redis.call("HSET", keys[1], p.session, cjson.encode(rec))
  redis.call("ZADD", keys[4], now + 600000, p.session)
  redis.call("HINCRBY", keys[5], "reserved", grew)
  redis.call("HINCRBY", keys[6], "admit", 1)
  return cjson.encode({ o = "admit", r = "reserved_session", w = 0, t = p.need, n = waiting, c = snap[3] })
end)
redis.register_function('kvgate_floor_release', function(keys, argv)
  local now = now_ms()
  local p = cjson.decode(argv[2])
  local rec = cjson.decode(redis.call("HGET", keys[1], p.session))
  rec.h, rec.k, rec.x = 0, nil, now + 60000
  redis.call("HSET", keys[1], p.session, cjson.encode(rec))
  redis.call("ZREM", keys[4], p.session)
  redis.call("ZADD", keys[7], rec.x, p.session)
  local waiting = redis.call("ZCARD", keys[3])
  redis.call("HINCRBY", keys[6], "released", 1)
  return cjson.encode({ released = 1, granted = 0, n = waiting })
end)
"""


def floor_turn(r: redis.Redis, gate: kvgate.Gate, turns: int) -> dict:
    """FLOOR_LIBRARY's turn (an acquire and a release call) on keys of its own under the gate's
    hash tag, cycling over SESSIONS sessions as the turns above do: its server microseconds per
    turn and the commands it runs."""
    names = ("sessions", "snapshot", "fifo", "lease_exp", "ledger", "totals", "window_exp")
    ks = [gate.key(f"floor_{n}") for n in names]
    # the snapshot the gate's own turns read, so the floor reads as many fields of as large a hash
    r.copy(gate.key("snapshot"), ks[1], replace=True)
    r.function_load(FLOOR_LIBRARY, replace=True)
    # ARGV as a kvgate call's: the clock ("" for the server's; the floor always reads TIME), then
    # the turn's parameters
    argv = [["", json.dumps({"ticket": f"t{i}", "session": f"s{i % SESSIONS}", "need": PROMPT + NEW_TOKENS})]
            for i in range(SESSIONS + turns)]
    try:
        for i, a in enumerate(argv):
            if i == SESSIONS:  # the sessions' first turns create their records: not measured
                r.config_resetstat()
            r.fcall("kvgate_floor_acquire", len(ks), *ks, *a)
            r.fcall("kvgate_floor_release", len(ks), *ks, *a)
        st = command_stats(r)
    finally:
        r.function_delete("kvgate_overhead_floor")
        r.delete(*ks)
    m = per_op(st, {"fcall"}, turns)
    return {"server_us": m["server_us"], "inner_commands": m["inner_commands"]}


def unit_steps(record: str) -> dict[str, str]:
    """Lua for the steps a kvgate script is made of, each measured alone: a command called
    from Lua (a read, a write), a stored JSON record decoded and encoded, a turn's parameters' JSON
    and the knobs' JSON decoded (the function library decodes the knobs once: common.lua), the
    clock, and the server's run_id (lua/includes/common.lua server_id)."""
    lit = json.dumps(record)  # a JSON string of ASCII is a valid Lua string literal
    return {"read command (HGET)": "redis.call('HGET', KEYS[1], 'reserved')",
            "write command (HSET)": "redis.call('HSET', KEYS[1], 'overhead_unit', '1')",
            "record decode": f"cjson.decode({lit})",
            "record decode + encode": f"cjson.encode(cjson.decode({lit}))",
            "parameters decode (ARGV[2])": "cjson.decode(ARGV[2])",
            "knobs decode (ARGV[3])": "cjson.decode(ARGV[3])",
            "TIME": "redis.call('TIME')",
            "INFO server": "redis.call('INFO', 'server')"}


# -- waiters queued --------------------------------------------------------------------------
class CountingGate(kvgate.AsyncGate):
    """An AsyncGate that counts its script calls by script (the crowd's own tally), and the
    tickets that were told to wait (its members in the FIFO, while they queue)."""

    def __init__(self, *a: Any, **kw: Any):
        super().__init__(*a, **kw)
        self.calls: Counter = Counter()
        self.waited: set[str] = set()

    async def _eval(self, op: Any) -> dict:
        self.calls[op.script] += 1
        out = await super()._eval(op)
        if op.script == "acquire" and isinstance(out, dict) and out.get("o") == "wait":
            self.waited.add(op.params["ticket"])
        return out


def crowd_config() -> kvgate.GateConfig:
    """The crowd's gate settings, also the parent's (its re-check must be the waiters' own: at
    the default max_wait_s a waiter queued that long is admitted as aged, not re-checked)."""
    return config(wait_poll_s=CROWD_POLL_S, max_wait_s=600.0, max_wait_hard_s=1200.0)


async def crowd(url: str, gate_name: str, members: range, handoff_s: float, report: Any, hold: bool = True,
                cluster: bool = False) -> None:
    """A crowd process: with ``hold``, one lease fills the gate; the sessions of ``members``
    queue behind it; once the parent has reset the server's counters ("go"), the lease is
    released and every admitted waiter releases at once and queues again, for ``handoff_s``.
    Several crowd processes may share one gate (benchmarks/scale.py): one holds. With
    ``cluster``, ``url`` is a node of a Redis Cluster, reached as a gate reaches one."""
    cfg = crowd_config()
    if cluster:
        timeouts = {k: v for k, v in client_kw().items() if k != "retry"}  # from_url sets its own
        gate = CountingGate.from_url(url, gate_name, cfg, cluster=True, max_connections=CROWD_BATCH, **timeouts)
        # read the slots before the first batch: redis-py's asyncio RedisCluster, first used by
        # a batch of calls at once, had some of them fail ("Connection closed by server") and
        # the gate degrade those turns; reading the slots first, none did
        await gate.redis.initialize()
    else:
        gate = CountingGate(async_client(url, CROWD_CONNECTIONS), gate=gate_name, config=cfg)
    batch = CROWD_BATCH // 2 if cluster else CROWD_BATCH
    turn = dict(prompt_tokens=PROMPT, max_new_tokens=NEW_TOKENS, retain_session=False)
    holder = await gate.acquire("holder", **turn) if hold else None
    if holder is not None and not holder.admitted:
        raise RuntimeError(f"the lease that fills the gate was not admitted: {holder!r}")
    events: list[tuple[str, float]] = []  # ("r", release began) / ("a", admitted), in order
    running = [True]
    admitted = [0]
    missed: Counter = Counter()  # turns not admitted (a call that timed out degrades its turn)

    async def member(k: int) -> None:
        while running[0]:
            lease = await gate.acquire(f"w{k}", **turn)
            if not lease.admitted:
                # counted and reported: a member that spun on bypasses would measure nothing
                missed[f"{lease.outcome}/{lease.reason}"] += 1
                return
            if not running[0]:
                return  # admitted after the window: it keeps the place, so the hand-offs stop
            events.append(("a", time.monotonic()))
            admitted[0] += 1
            events.append(("r", time.monotonic()))
            await lease.release()

    # queue in batches, each waited for: 10,000 first calls at once would wait on the pool
    # past the gate's call deadline, and a turn whose call timed out is degraded, not queued
    deadline = time.monotonic() + CROWD_START_S
    tasks = []
    for start in range(members.start, members.stop, batch):
        tasks += [asyncio.ensure_future(member(k)) for k in range(start, min(members.stop, start + batch))]
        while len(gate.waited) < len(tasks):
            if missed or time.monotonic() > deadline:
                raise RuntimeError(f"{len(tasks)} waiters did not queue within {CROWD_START_S}s: {dict(missed)}")
            await asyncio.sleep(0.05)
    report.send("queued")
    if not report.poll(CROWD_START_S):
        raise RuntimeError("the parent did not say go")
    report.recv()
    gate.calls.clear()
    t0 = time.monotonic()
    if holder is not None:
        events.append(("r", t0))
        await holder.release()
    await asyncio.sleep(handoff_s)
    running[0] = False
    report.send({"handoffs": admitted[0], "elapsed_s": time.monotonic() - t0, "events": list(events),
                 "calls": dict(gate.calls), "missed": dict(missed)})
    # the parent stops this process by pid before it reads the server's counters: cancelling
    # the waiters here would send their cancel calls into those counters
    await asyncio.sleep(CROWD_RESULT_S)


def crowd_main(url: str, gate_name: str, members: range, handoff_s: float, report: Any, hold: bool = True,
               cluster: bool = False) -> None:
    try:
        asyncio.run(crowd(url, gate_name, members, handoff_s, report, hold, cluster))
    except Exception as e:  # noqa: BLE001 - the parent raises it, instead of waiting out its bound
        report.send({"error": f"{type(e).__name__}: {e}"})


def wake_latencies(events: list[tuple[str, float]]) -> list[float]:
    """From a release to the next admission, over the events of every crowd process in time
    order (time.monotonic is one clock for every process of the machine)."""
    wake, last_release = [], None
    for kind, t in sorted(events, key=lambda e: e[1]):
        if kind == "r":
            last_release = t
        elif last_release is not None:
            wake.append(t - last_release)
            last_release = None
    return wake


def recheck_cost(r: Any, gate: kvgate.Gate, node: redis.Redis) -> float:
    """Server microseconds of one waiter's re-check (what each waiter sends once per poll),
    over waiters spread along the FIFO: the call its own flow would make, made from here
    (``node``: the server of the gate's slot, whose counters time it)."""
    tickets = r.zrange(gate.key("fifo"), 0, -1)
    sample = tickets[::max(1, len(tickets) // RECHECKS)][:RECHECKS]
    node.config_resetstat()
    for t in sample:
        w = json.loads(r.hget(gate.key("waiters"), t))
        params = acquire_params(t.decode(), w["s"], need=w["n"], prompt=w["p"])
        out = gate._eval(gate._flows.eval_op("acquire", params))
        if out["o"] != "wait":
            raise RuntimeError(f"a re-check of a queued waiter did not wait: {out}")
    return sum(v["usec"] for k, v in command_stats(node).items() if k in SCRIPT_CALLS) / len(sample)


def run_crowd(r: redis.Redis, url: str, name: str, w: int, handoff_s: float, procs: int = 1) -> dict:
    """One waiters level: ``w`` waiters in ``procs`` crowd processes (the first holds the
    lease that fills the gate) queue on gate ``name``, then hand its one place from head to
    head for ``handoff_s``; the figures per hand-off."""
    return run_crowds(r, url, {name: (w, procs)}, handoff_s)["gates"][name]


def stop(procs: list) -> None:
    """Kill processes by pid and reap them."""
    for proc in procs:
        proc.kill()
    for proc in procs:
        proc.join(timeout=10)


def run_crowds(r: Any, url: str, crowds: dict[str, tuple[int, int]], handoff_s: float) -> dict:
    """``run_crowd`` on several gates at once: gate name -> (waiters, processes), every crowd
    queued before any hands off, then all hand off together. ``r`` is a client of one Redis
    or a ``RedisCluster`` (the crowds then reach the cluster as a gate does). Returns
    ``gates`` (each gate's figures; its server figures are its node's over the admissions of
    the gates on that node), ``nodes`` (per node: its gates and server figures) and
    ``total`` (every gate's admissions; the server figures summed over the nodes)."""
    ctx = multiprocessing.get_context("spawn")
    cluster = isinstance(r, redis.RedisCluster)
    nodes = server_nodes(r)
    where = {name: node_of(r, name) for name in crowds}
    gates, shas, running = {}, {}, []
    for name in crowds:
        gate = gates[name] = kvgate.Gate(r, gate=name, config=crowd_config())
        # a ceiling (capacity x headroom 0.9) that holds one turn and not two
        gate.write_snapshot(engine(int((PROMPT + NEW_TOKENS) * 1.5 / 0.9)))
        # a slowlog entry names the function (FCALL) or the script's SHA (EVALSHA)
        shas.update({gate._caller.functions[s]: s for s in SCRIPT_NAMES})
        shas.update({gate._caller.shas[s]: s for s in SCRIPT_NAMES})
    by_key = {kvkeys.key(name, "ledger"): name for name in crowds}

    def queued(name: str, parent: Any) -> None:
        msg = parent.recv() if parent.poll(CROWD_START_S + 10) else {"error": "no word within its bound"}
        if msg != "queued":
            raise RuntimeError(f"the crowd of {crowds[name][0]} on {name} did not queue: {msg}")
    try:
        pipes = {name: [] for name in crowds}
        # a round per process index, one process of each gate: every gate's holder first, and
        # every gate's waiters queued alike over the rounds, so their re-checks (each waiter's
        # every CROWD_POLL_S) fall alike in each gate's window, not all in the first gate's
        rounds = max(procs for _, procs in crowds.values())
        for i, name in ((i, name) for i in range(rounds) for name in crowds if i < crowds[name][1]):
            w, procs = crowds[name]
            parent, child = ctx.Pipe()
            members = range(w * i // procs, w * (i + 1) // procs)
            proc = ctx.Process(target=crowd_main, args=(url, name, members, handoff_s, child, i == 0, cluster),
                               daemon=True)
            proc.start()
            pipes[name].append(parent)
            running.append(proc)
            # one process at a time: the holder's lease first (the others' members must all
            # wait), then each queues while the others only wait (64 processes starting at
            # once on two cores pushed their first calls past the gate's deadline: degraded)
            queued(name, parent)
        recheck_us = {name: recheck_cost(r, gates[name], nodes[where[name]]) for name in crowds}
        for node in nodes.values():
            node.config_set("slowlog-log-slower-than", 0)
            node.config_set("slowlog-max-len", 1_000_000)
            node.slowlog_reset()
            node.config_resetstat()
        for parent in (p for ps in pipes.values() for p in ps):
            parent.send("go")
        results: dict[str, list[dict]] = {}
        for name, ps in pipes.items():
            for parent in ps:
                if not parent.poll(CROWD_RESULT_S + handoff_s):
                    raise RuntimeError(f"the crowd of {crowds[name][0]} on {name} sent no result")
                results.setdefault(name, []).append(parent.recv())
                if "error" in results[name][-1]:
                    raise RuntimeError(f"the crowd on {name} failed: {results[name][-1]['error']}")
        stop(running)  # no call of a crowd lands in the counters after its result
        stats = {addr: command_stats(node) for addr, node in nodes.items()}
        slow = [e for node in nodes.values() for e in node.slowlog_get(1_000_000)]
        left = {name: r.zcard(gates[name].key("fifo")) for name in crowds}  # the crowd stopped queueing: about w - 1
        for node in nodes.values():
            node.config_set("slowlog-log-slower-than", 10_000)
    finally:
        stop(running)
    by_script: dict[str, dict[str, list[int]]] = {name: {} for name in crowds}
    for e in slow:
        cmd = e["command"].split() if isinstance(e["command"], (bytes, str)) else e["command"]
        cmd = [c.decode() if isinstance(c, bytes) else c for c in cmd]
        if len(cmd) > 3 and cmd[0].lower() in SCRIPT_CALLS and cmd[1] in shas and cmd[3] in by_key:
            by_script[by_key[cmd[3]]].setdefault(shas[cmd[1]], []).append(int(e["duration"]))
    handoffs = {name: sum(x["handoffs"] for x in res) for name, res in results.items()}
    node_out = {}
    for addr in nodes:
        on = [name for name in crowds if where[name] == addr]
        node_out[addr] = {"gates": on, **per_op(stats[addr], CLIENT_COMMANDS["kvgate"],
                                                 max(1, sum(handoffs[name] for name in on)))}
    out: dict[str, Any] = {"gates": {}, "nodes": node_out}
    wake_all: list[float] = []
    for name, res in results.items():
        n = max(1, handoffs[name])
        wake = wake_latencies([e for x in res for e in x["events"]])
        wake_all += wake
        out["gates"][name] = {
            "handoffs": handoffs[name], "handoffs_per_s": handoffs[name] / res[0]["elapsed_s"],
            "wake_p50_ms": quantile(wake, 0.5) * 1000, "wake_p99_ms": quantile(wake, 0.99) * 1000,
            "queued_after": left[name], "missed": dict(sum((Counter(x["missed"]) for x in res), Counter())),
            "recheck_us": recheck_us[name],
            **{k: v for k, v in node_out[where[name]].items() if k != "gates"},
            "calls_by_script": {k: v / n for k, v in
                                sorted(sum((Counter(x["calls"]) for x in res), Counter()).items())},
            "script_us_per_call": {k: statistics.median(v) for k, v in sorted(by_script[name].items())},
        }
        r.delete(*gates[name]._keys)
    g = out["gates"].values()
    total = sum(m["handoffs"] for m in g)
    summed: dict[str, dict] = {}
    for st in stats.values():
        for k, v in st.items():
            acc = summed.setdefault(k, {"calls": 0, "usec": 0})
            acc["calls"] += v["calls"]
            acc["usec"] += v["usec"]
    every: dict[str, list[int]] = {}
    for per_gate in by_script.values():
        for k, v in per_gate.items():
            every.setdefault(k, []).extend(v)
    out["total"] = {"handoffs": total, "handoffs_per_s": sum(m["handoffs_per_s"] for m in g),
                    "wake_p50_ms": quantile(wake_all, 0.5) * 1000, "wake_p99_ms": quantile(wake_all, 0.99) * 1000,
                    "missed": dict(sum((Counter(m["missed"]) for m in g), Counter())),
                    "recheck_us": statistics.mean(m["recheck_us"] for m in g),
                    **per_op(summed, CLIENT_COMMANDS["kvgate"], max(1, total)),
                    "script_us_per_call": {k: statistics.median(v) for k, v in sorted(every.items())}}
    return out


def quiet_handoffs(r: redis.Redis, name: str, w: int, handoffs: int) -> dict:
    """The crowd's hand-off with nothing else running: this client queues ``w`` waiters on
    gate ``name`` (one lease fills it) and makes every call of each hand-off itself, one after
    another (the release that grants the head, the head's claim, the releaser queueing again),
    so the server's figures per hand-off show its work against the queue's length without a
    crowd's processes sharing the machine's cores."""
    gate = kvgate.Gate(r, gate=name, config=crowd_config())
    gate.write_snapshot(engine(int((PROMPT + NEW_TOKENS) * 1.5 / 0.9)))

    def acquire(ticket: str, session: str, want: str) -> None:
        out = gate._eval(gate._flows.eval_op("acquire", acquire_params(ticket, session)))
        if out["o"] != want:
            raise RuntimeError(f"a quiet hand-off's acquire answered {out}, not {want!r}")

    holder, ticket = "holder", {"holder": "h"}  # session -> its current attempt's ticket
    acquire("h", holder, "admit")
    queue: deque[str] = deque()
    for i in range(w):
        queue.append(f"q{i}")
        ticket[f"q{i}"] = f"q{i}.0"
        acquire(ticket[f"q{i}"], f"q{i}", "wait")
    r.config_resetstat()
    for n in range(handoffs):
        gate._eval(gate._flows.eval_op("release", dict(ticket=ticket[holder])))
        head = queue.popleft()
        acquire(ticket[head], head, "admit")  # its grant, claimed
        ticket[holder] = f"{holder}.{n + 1}"
        acquire(ticket[holder], holder, "wait")  # the releaser queues again
        queue.append(holder)
        holder = head
    m = per_op(command_stats(r), SCRIPT_CALLS, handoffs)
    gate.close()
    return {"server_us": m["server_us"], "script_calls": m["script_calls"], "inner_commands": m["inner_commands"]}


def run_waiters(url: str, levels: tuple[int, ...], handoff_s: float) -> dict:
    r = redis.Redis.from_url(url, **client_kw())
    out = {str(w): run_crowd(r, url, f"overhead-w{w}", w, handoff_s) for w in levels}
    for w in levels:
        out[str(w)]["quiet"] = quiet_handoffs(r, f"overhead-quiet-w{w}", w, QUIET_HANDOFFS)
    r.close()
    return out


# -- output ----------------------------------------------------------------------------------
def table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
                     for row in rows)


def f(x: float, nd: int = 1) -> str:
    return f"{x:,.{nd}f}"


def report(res: dict) -> str:
    head = ["subject", "p50 ms", "p99 ms", "ops/s", "server us/op", "scripts/op", "inner cmds/op"]

    def row(label: str, m: dict) -> list[str]:
        return [label, f(m["p50_ms"], 3), f(m["p99_ms"], 3), f(m["ops_per_s"], 0), f(m["server_us"]),
                f(m["script_calls"], 2), f(m["inner_commands"], 1)]

    parts = [f"redis-server {res['redis_version']}, kvgate from {res['kvgate']}, {res['rounds']} rounds, "
             f"medians over rounds", f"(a turn: a {res['prompt_tokens']:,}-token prompt and {NEW_TOKENS} new tokens)",
             "", "one sync client", table([head] + [row(k, v) for k, v in res["sync"].items()])]
    rows = [["subject x callers"] + head[1:]]
    for name, levels in res["async"].items():
        rows += [row(f"{name} x{c}", m) for c, m in levels.items()]
    parts += ["", "one asyncio loop", table(rows)]
    b = res["breakdown"]
    rows = [["script", "server us/call", "inner cmds/call", "their us", "inner commands (per call)"]]
    for name in ("acquire", "release"):
        m = b[name]
        rows.append([name, f(m["server_us"]), f(m["inner_commands"], 1), f(m["inner_us"]),
                     " ".join(f"{k}={v:g}" for k, v in m["by_command"].items())])
    rows.append(["(return 1)", f(b["return_1"]["server_us"]), "0", "0",
                 "an EVALSHA with a kvgate call's KEYS and ARGV"])
    rows.append(["(helpers only)", f(b["helpers_only"]["server_us"]), "0", "0",
                 "the same, defining lua/includes, then an empty body through run: the EVAL form's fixed cost"])
    rows.append(["(empty function)", f(b["function_empty"]["server_us"]), "0", "0",
                 "an FCALL of an empty body through run: the function form's fixed cost"])
    rows.append(["(a turn's floor)", f(b["floor"]["server_us"]), f(b["floor"]["inner_commands"], 1), "",
                 "per turn, both calls: the least a window's turn does in any layout (FLOOR_LIBRARY)"])
    parts += ["", f"a sync turn, script by script ({b['turns']} turns: {b['reasons']})", table(rows)]
    rows = [["one step inside a script", "server us"]] + [[k, f(v)] for k, v in b["units_us"].items()]
    parts += ["", "what a script's steps cost (each run alone, less an empty call)", table(rows)]
    c = res["client"]
    rows = [["a sync turn, client side", "us per turn"],
            ["the whole turn", f(c["turn_us"])],
            ["inside the gate's redis-py calls (wire, redis-py, server)", f(c["in_redis_py_us"])],
            ["kvgate's own Python (the rest)", f(c["kvgate_python_us"])],
            ["two FCALLs that return at once, a turn's KEYS and ARGV", f(c["bare_pair_us"])]]
    parts += ["", "where a sync turn's time goes (medians of alternating blocks)", table(rows)]
    rows = [["waiters", "wake p50 ms", "wake p99 ms", "handoffs/s", "server us/handoff", "scripts/handoff",
             "inner cmds/handoff", "not admitted", "re-check us", "script us/call"]]
    for w, m in res["waiters"].items():
        rows.append([w, f(m["wake_p50_ms"], 3), f(m["wake_p99_ms"], 3), f(m["handoffs_per_s"], 0),
                     f(m["server_us"]), f(m["script_calls"], 2), f(m["inner_commands"], 1),
                     str(sum(m["missed"].values())), f(m["recheck_us"]),
                     " ".join(f"{k}={v:g}" for k, v in m["script_us_per_call"].items())])
    parts += ["", "waiters queued (one place handed from head to head)", table(rows)]
    rows = [["waiters", "server us/handoff", "scripts/handoff", "inner cmds/handoff"]]
    for w, m in res["waiters"].items():
        q = m["quiet"]
        rows.append([w, f(q["server_us"]), f(q["script_calls"], 2), f(q["inner_commands"], 1)])
    parts += ["", f"the same hand-offs made one after another by one client, nothing else running "
                  f"({QUIET_HANDOFFS} per level)", table(rows)]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run: fewer operations, 10 and 100 waiters")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    ap.add_argument("--rounds", type=int, help="interleaved rounds (default: 5, --quick 2)")
    a = ap.parse_args(argv)
    prof = dict(PROFILES["quick" if a.quick else "full"])
    if a.rounds is not None:
        if a.rounds < 1:
            ap.error("--rounds must be >= 1")
        prof["rounds"] = a.rounds
    t0 = time.monotonic()

    def phase(name: str, fn: Callable[[], Any]) -> Any:
        # progress on stderr: the figures go to stdout alone
        print(f"[{time.monotonic() - t0:6.1f}s] {name}", file=sys.stderr, flush=True)
        return fn()

    with embedded_redis("redis-server") as (url, _kind):
        r = redis.Redis.from_url(url, **client_kw())
        version = r.info("server")["redis_version"]
        r.close()
        res = {"redis_version": version, "kvgate": str(Path(kvgate.__file__).parent), "prompt_tokens": PROMPT,
               "rounds": prof["rounds"],
               "sync": phase("one sync client", lambda: run_sync(url, prof["rounds"], prof["sync_ops"])),
               "async": phase("one asyncio loop",
                              lambda: asyncio.run(async_blocks(url, prof["rounds"], prof["async_ops"]))),
               "breakdown": phase("script by script", lambda: script_breakdown(url, prof["breakdown_turns"])),
               "client": phase("client side", lambda: client_split(url, prof["rounds"], prof["sync_ops"])),
               "waiters": phase("waiters queued", lambda: run_waiters(url, prof["waiters"], prof["handoff_s"]))}
    res["elapsed_s"] = time.monotonic() - t0
    print(json.dumps(res, indent=1) if a.json else report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
