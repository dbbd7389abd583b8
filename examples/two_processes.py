#!/usr/bin/env python3
"""Two OS processes sharing one kvgate gate through one Redis.

What it does:

1. Redis: ``--redis URL``, or (default) a private ``redis-server`` on a free loopback port,
   stopped by pid at exit.
2. Engines: ``--router URL`` / ``--engine URL ...`` (SGLang or vLLM, ``--kind``), or (default)
   kvgate's SGLang SIMULATOR (``kvgate.tools.sim.SimCluster``: 2 engines + a router on loopback, with a
   small KV pool so the gate has something to do).  It is a simulator, not SGLang.
3. Snapshots: ``--snapshots poller`` (default) runs a ``kvgate.control.poller.Poller`` in a thread of this
   process (router ``/workers`` -> engine ``/metrics`` -> ``gate.write_snapshot``); ``external``
   expects a ``kvgate poller`` elsewhere (docker compose) and only waits for its first snapshot.
4. ``--processes`` (2) worker processes, each with its own ``kvgate.Gate`` on the same Redis and gate
   name, run ``--sessions`` agent sessions in threads.  Every turn is wrapped in
   ``with gate.turn(session_id, prompt_ids=..., max_new_tokens=...) as lease:``; the prompt grows
   by the model output and a tool result each turn, with a tool pause between turns (outside the
   lease).  Each session ends with ``gate.finish_session``.
5. Prints one line per turn (``[p0] p0s1 turn 2: admit/open waited=0.00s ...``), then the gate's
   status and a ``RESULT {json}`` line (per-process outcomes, final ledger).

    python examples/two_processes.py                                   # everything private, ~10 s
    python examples/two_processes.py --redis redis://127.0.0.1:6379/0  # your Redis, private simulator
    python examples/two_processes.py --redis redis://redis:6379/0 --router http://router:30000 \\
        --snapshots external --kind sglang --session-lifecycle         # docker compose (rollout-*)

Exit status: 0 when every worker finished and no engine call failed, 1 otherwise.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import queue
import random
import sys
import threading
import time
import uuid
import zlib
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

import kvgate
from _support import private_redis, say, start_poller  # examples/_support.py (a private redis-server, atomic lines, a poller thread)

# Example defaults (environment KVGATE_* still wins): short waits so the demo stays short.
EXAMPLE_KNOBS = dict(max_wait_s=5.0, wait_poll_s=0.5, idle_grace_s=10.0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="two_processes.py",
                                description="Two OS processes sharing one kvgate gate through one Redis.")
    p.add_argument("--redis", metavar="URL", default=None,
                   help="Redis URL (default: start a private redis-server on a free port)")
    p.add_argument("--gate", default="example", help="gate name (default: example)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--router", metavar="URL", help="router base URL (sgl-router or the simulator's)")
    src.add_argument("--engine", metavar="URL", action="append", help="engine base URL (repeatable)")
    p.add_argument("--kind", choices=["sglang", "vllm"], default="sglang",
                   help="engine API: sglang POST /generate, vllm POST /v1/completions")
    p.add_argument("--model", default=None, help="vLLM model name (default: the first of GET /v1/models)")
    p.add_argument("--snapshots", choices=["poller", "external"], default="poller",
                   help="poller: run a kvgate Poller in this process; external: a `kvgate poller` runs elsewhere")
    p.add_argument("--snapshot-wait-s", type=float, default=None,
                   help="how long to wait for the first snapshot (default 15 s; 300 s with --snapshots external)")
    p.add_argument("--session-lifecycle", action=argparse.BooleanOptionalAction, default=None,
                   help="send session_id on /generate and /close_session at finish (SGLang with "
                        "--enable-session-radix-cache; default: KVGATE_SESSION_LIFECYCLE, else off)")
    p.add_argument("--probe", action="store_true",
                   help="residency probe: POST /kvgate/probe on the snapshot's engines (vLLM plugin, simulator)")
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--sessions", type=int, default=4, help="sessions per process")
    p.add_argument("--turns", type=int, default=4, help="turns per session")
    p.add_argument("--first-prompt", type=int, default=3000, help="tokens in the first prompt")
    p.add_argument("--tool-tokens", type=int, default=300, help="tokens of each tool result")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--tool-pause-s", type=float, default=0.2, help="median tool pause (lognormal)")
    p.add_argument("--sim-engines", type=int, default=2)
    p.add_argument("--sim-kv-tokens", type=int, default=8192, help="KV pool per simulated engine")
    p.add_argument("--sim-time-scale", type=float, default=0.2)
    p.add_argument("--timeout-s", type=float, default=60.0,
                   help="bound on the workers' run, counted from when they start (after the wait "
                        "for the first snapshot, which --snapshot-wait-s bounds)")
    p.add_argument("--request-timeout-s", type=float, default=20.0, help="bound on each engine call")
    p.add_argument("--seed", type=int, default=0)
    return p


def check_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    for name in ("processes", "sessions", "turns", "first_prompt", "max_new_tokens", "sim_engines", "sim_kv_tokens"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.tool_tokens < 0 or a.tool_pause_s < 0 or a.sim_time_scale < 0 or a.timeout_s <= 0:
        p.error("--tool-tokens, --tool-pause-s, --sim-time-scale must be >= 0 and --timeout-s > 0")
    if a.snapshots == "external" and not (a.router or a.engine):
        p.error("--snapshots external needs --router or --engine (the engines the external poller watches)")
    if a.kind == "vllm" and not (a.router or a.engine):
        p.error("--kind vllm needs --router or --engine (the private simulator speaks SGLang)")


# -- engines --------------------------------------------------------------------------------------
class EngineCaller:
    """One engine call per turn; returns (output token ids, cached prompt tokens or None)."""

    def __init__(self, kind: str, urls: list[str], model: str | None, session_ids: bool, timeout_s: float):
        self.kind, self.urls, self.model, self.session_ids = kind, urls, model, session_ids
        self.http = httpx.Client(timeout=timeout_s, trust_env=False)

    def _url(self, session_id: str) -> str:
        # one URL (a router) or several engines: keep a session on one engine (its prefix lives there)
        return self.urls[zlib.crc32(session_id.encode()) % len(self.urls)]

    def generate(self, session_id: str, ids: list[int], max_new: int) -> tuple[list[int], int | None]:
        base = self._url(session_id)
        if self.kind == "sglang":
            body: dict[str, Any] = {"input_ids": ids,
                                    "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0,
                                                        "ignore_eos": True}}
            if self.session_ids:
                body["session_id"] = session_id
            r = self.http.post(base + "/generate", json=body)
            r.raise_for_status()
            out = r.json()
            meta = out.get("meta_info") or {}
            toks = out.get("output_ids")
            if not isinstance(toks, list):  # builds that return text only: stand-in ids of the same length
                toks = [1] * int(meta.get("completion_tokens", max_new))
            return [int(t) for t in toks], meta.get("cached_tokens")
        if self.model is None:
            r = self.http.get(base + "/v1/models")
            r.raise_for_status()
            self.model = r.json()["data"][0]["id"]
        r = self.http.post(base + "/v1/completions", json={
            "model": self.model, "prompt": ids, "max_tokens": max_new, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True})
        r.raise_for_status()
        out = r.json()
        choice = out["choices"][0]
        toks = choice.get("token_ids")
        usage = out.get("usage") or {}
        if not isinstance(toks, list):
            toks = [1] * int(usage.get("completion_tokens", max_new))
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        return [int(t) for t in toks], cached

    def close(self) -> None:
        self.http.close()


# -- one worker process ------------------------------------------------------------------------------
def worker(idx: int, opts: dict, results: Any) -> None:
    """Runs in its own OS process: its own Gate (own Redis connections), several sessions in threads."""
    cfg = kvgate.GateConfig.from_env(base=kvgate.GateConfig(**opts["knobs"]))
    gate = kvgate.Gate.from_url(opts["redis"], gate=opts["gate"], config=cfg)
    if opts["probe"]:
        from kvgate.integrations.http_probe import HttpProbe
        gate.probe = HttpProbe(gate.engine_urls, timeout_s=cfg.probe_timeout_s)  # engines of the latest snapshot
    # session_id on /generate: needed by the session lifecycle; the simulator's router also uses it
    # to keep a session on one engine (sgl-router's cache_aware policy does that by prefix instead)
    caller = EngineCaller(opts["kind"], opts["gen_urls"], opts["model"], opts["send_session_id"],
                          timeout_s=opts["request_timeout_s"])
    tally: Counter = Counter()
    lock = threading.Lock()
    errors: list[str] = []

    def session(j: int) -> None:
        sid = f"{opts['run']}-p{idx}s{j}"
        rng = random.Random(f"{opts['seed']}/{idx}/{j}")
        history = [rng.randrange(100, 30000) for _ in range(opts["first_prompt"])]
        try:
            for t in range(opts["turns"]):
                err = None
                cached = None
                with gate.turn(sid, prompt_ids=history, max_new_tokens=opts["max_new_tokens"],
                               turn_index=t) as lease:
                    try:
                        out, cached = caller.generate(sid, history, opts["max_new_tokens"])
                    except (httpx.HTTPError, ValueError, KeyError) as e:  # the engine failed, not the gate
                        err, out = f"{type(e).__name__}: {e}", []
                say(f"[p{idx}] {sid} turn {t}: {lease.outcome}/{lease.reason or '-'} "
                    f"waited={lease.waited_s:.2f}s tokens={lease.tokens} prompt={len(history)} "
                    f"cached={cached if cached is not None else '?'}" + (f" error={err}" if err else ""))
                with lock:
                    tally["turns"] += 1
                    tally[f"{lease.outcome}/{lease.reason or '-'}"] += 1
                    if err:
                        errors.append(err)
                # the model's output and the tool's result extend the history; the tool runs outside the lease
                history += out + [rng.randrange(100, 30000) for _ in range(opts["tool_tokens"])]
                time.sleep(min(5.0, rng.lognormvariate(0.0, 0.8) * opts["tool_pause_s"]))
        finally:
            res = gate.finish_session(sid)
            with lock:
                tally["finished"] += 1
                if res.get("close"):
                    tally["close_failures"] += res["close"].get("failures", 0)

    try:
        with ThreadPoolExecutor(max_workers=opts["sessions"], thread_name_prefix=f"p{idx}") as pool:
            for f in [pool.submit(session, j) for j in range(opts["sessions"])]:
                f.result()
    finally:
        caller.close()
        gate.close()
    results.put({"process": idx, "pid": os.getpid(), "tally": dict(tally), "errors": errors[:5],
                 "n_errors": len(errors)})


# -- the parent ---------------------------------------------------------------------------------------
def wait_for_snapshot(gate: kvgate.Gate, wait_s: float) -> dict:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            st = gate.status()
            if not st["degraded"]:
                return st
        except Exception as e:  # noqa: BLE001 - Redis may still be starting
            st = {"error": str(e)}
        if time.monotonic() > deadline:
            print(f"no fresh snapshot after {wait_s:.0f} s; turns will bypass as degraded ({st})", flush=True)
            return st
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    own_sim = not (args.router or args.engine)
    cfg = kvgate.GateConfig.from_env(base=kvgate.GateConfig(**EXAMPLE_KNOBS))
    if args.session_lifecycle is not None:  # the flag beats KVGATE_SESSION_LIFECYCLE
        cfg = cfg.replace(session_lifecycle=args.session_lifecycle)
    t_start = time.monotonic()

    with contextlib.ExitStack() as stack:
        redis_url = args.redis or stack.enter_context(private_redis())
        if own_sim:
            from kvgate.tools.sim import SimCluster
            sim = stack.enter_context(SimCluster(args.sim_engines, "gpu-h100-30b", time_scale=args.sim_time_scale,
                                                 session_radix_cache=cfg.session_lifecycle,
                                                 kv_capacity_tokens=args.sim_kv_tokens))
            router, engines = sim.router_url, None
            print(f"started the SGLang SIMULATOR: router {router}, engines {sim.engine_urls} "
                  f"({args.sim_kv_tokens} KV tokens each)", flush=True)
        else:
            router, engines = args.router, args.engine
        gate = stack.enter_context(kvgate.Gate.from_url(redis_url, gate=args.gate, config=cfg))

        if args.snapshots == "poller":
            start_poller(stack, gate, router=router, engines=engines)
        wait_s = args.snapshot_wait_s if args.snapshot_wait_s is not None else (
            300.0 if args.snapshots == "external" else 15.0)
        st = wait_for_snapshot(gate, wait_s)
        print(f"gate {args.gate!r}: capacity={st.get('capacity')} ceiling={st.get('ceiling')} "
              f"usage={st.get('usage')} engines={len(st.get('engines') or [])} config={cfg.to_dict()}", flush=True)

        opts = dict(redis=redis_url, gate=args.gate, knobs={**cfg.to_dict(), "engine_urls": tuple(cfg.engine_urls)},
                    probe=args.probe, kind=args.kind, model=args.model, gen_urls=[router] if router else list(engines),
                    sessions=args.sessions, turns=args.turns, first_prompt=args.first_prompt,
                    tool_tokens=args.tool_tokens, max_new_tokens=args.max_new_tokens,
                    tool_pause_s=args.tool_pause_s, seed=args.seed, request_timeout_s=args.request_timeout_s, run=uuid.uuid4().hex[:6],
                    send_session_id=cfg.session_lifecycle or own_sim)
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        # the run's bound starts with the workers: the setup and the wait for the first snapshot
        # (up to 300 s with --snapshots external, docs/deploy.md) have bounds of their own
        deadline = time.monotonic() + args.timeout_s
        procs = [ctx.Process(target=worker, args=(i, opts, results), name=f"kvgate-example-p{i}")
                 for i in range(args.processes)]
        for pr in procs:
            pr.start()
        print(f"started {len(procs)} worker processes: pids {[pr.pid for pr in procs]}", flush=True)
        reports: list[dict] = []
        try:
            while len(reports) < len(procs) and time.monotonic() < deadline:
                try:
                    reports.append(results.get(timeout=0.5))
                except queue.Empty:
                    if all(not pr.is_alive() for pr in procs) and results.empty():
                        break
            for pr in procs:
                pr.join(max(0.1, deadline - time.monotonic()))
        finally:
            for pr in procs:
                if pr.is_alive():
                    print(f"worker pid {pr.pid} still running at the deadline: terminating it", flush=True)
                    pr.terminate()
                    pr.join(5)

        gate.housekeep()
        st = gate.status()
        metrics = gate.step_metrics(drain=True)
        ok = (len(reports) == len(procs) and all(pr.exitcode == 0 for pr in procs)
              and all(r["n_errors"] == 0 for r in reports))
        print(f"gate status: reserved={st['reserved']} ceiling={st['ceiling']} leases={st['leases']} "
              f"windows={st['windows']} waiting={st['waiting']} usage={st['usage']:.3f} epoch={st['epoch']} "
              f"degraded={st['degraded']}", flush=True)
        keep = ("admit", "bypass", "wait", "defer_rate", "wait_seconds_mean", "session/close",
                "session/close_failure", "budget/lease_count")
        print("step metrics: " + ", ".join(f"{k}={v:g}" for k, v in sorted(metrics.items())
                                           if any(k.endswith(s) for s in keep)), flush=True)
        print("RESULT " + json.dumps({
            "ok": ok, "seconds": round(time.monotonic() - t_start, 2),
            "processes": sorted(reports, key=lambda r: r["process"]),
            "exitcodes": [pr.exitcode for pr in procs],
            "expected_turns_per_process": args.sessions * args.turns,
            "status": {k: st[k] for k in ("reserved", "ceiling", "leases", "windows", "waiting", "epoch",
                                          "degraded")}}), flush=True)
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
