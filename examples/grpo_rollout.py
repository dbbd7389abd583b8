#!/usr/bin/env python3
"""A GRPO-style rollout with ``kvgate.AsyncGate``: n samples of every task, all sharing the
task's prompt (and every task the same system prompt), then diverging turn by turn.

Every turn of a sample tells the gate which prefixes its prompt shares, outermost first (the
system prompt, then the task's prompt that starts with it), so the ledger charges each once, as
the engines' prefix caches store each once::

    shared = len(system_prompt) + len(task_prompt)
    async with gate.turn(sample_id, prompt_ids=history, max_new_tokens=n,
                         prefix_key=["system", f"task-{task}"],
                         prefix_tokens=[len(system_prompt), shared]) as lease:
        out = await engine.generate(history)
    history += out + await tool(...)              # the tool pause, outside the lease
    ...
    await gate.finish_session(sample_id)          # the task's last sample gives its prompt back
                                                  # (and the last sample of all the system prompt)

By default it starts a private redis-server, kvgate's SGLang SIMULATOR (``SimCluster``, one
engine, a small KV pool) and a ``Poller`` in a thread. ``--no-share`` runs the same rollout
without telling the gate what is shared, to compare.

    python examples/grpo_rollout.py
    python examples/grpo_rollout.py --tasks 4 --samples 8 --no-share

Prints one line per turn, the gate's sharing metrics and a ``RESULT {json}`` line.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from collections import Counter

import httpx

import kvgate
from _support import private_redis, say, start_poller, wait_fresh  # examples/_support.py

EXAMPLE_KNOBS = dict(max_wait_s=5.0, wait_poll_s=0.5, idle_grace_s=10.0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="grpo_rollout.py", description="a GRPO-style rollout with kvgate.AsyncGate")
    p.add_argument("--redis", metavar="URL", default=None, help="Redis URL (default: a private redis-server)")
    p.add_argument("--gate", default="grpo-example")
    p.add_argument("--tasks", type=int, default=3)
    p.add_argument("--samples", type=int, default=4, help="samples per task (GRPO's n)")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-tokens", type=int, default=512, help="the system prompt every task starts with")
    p.add_argument("--task-tokens", type=int, default=1024, help="each task's own prompt")
    p.add_argument("--tool-tokens", type=int, default=128)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--tool-pause-s", type=float, default=0.1, help="median tool pause (lognormal)")
    p.add_argument("--no-share", action="store_true", help="do not tell the gate which prefixes are shared")
    p.add_argument("--sim-kv-tokens", type=int, default=16384)
    p.add_argument("--sim-time-scale", type=float, default=0.2)
    p.add_argument("--timeout-s", type=float, default=60.0, help="bound on the whole run")
    p.add_argument("--seed", type=int, default=0)
    return p


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 30000) for _ in range(n)]


class Sample:
    """One sample of one task: the shared first prompt, then its own outputs and tool results."""

    def __init__(self, task: int, k: int, first_prompt: list[int], gate: kvgate.AsyncGate,
                 http: httpx.AsyncClient, url: str, args: argparse.Namespace, stats: dict):
        self.sid = f"task-{task}/sample-{k}"
        self.task, self.gate, self.http, self.url, self.args, self.stats = task, gate, http, url, args, stats
        self.history = list(first_prompt)
        # the system prompt (when there is one), then this task's whole first prompt
        levels = [("system", args.system_tokens)] if args.system_tokens else []
        levels.append((f"task-{task}", len(first_prompt)))
        self.share = {} if args.no_share else {"prefix_key": [k for k, _ in levels],
                                                "prefix_tokens": [t for _, t in levels]}
        # samples diverge: temperature > 0 in a real rollout; here each draws its own tools
        self.rng = random.Random(f"{args.seed}/{self.sid}")

    async def generate(self) -> tuple[list[int], int | None]:
        body = {"input_ids": self.history, "sampling_params": {
            "max_new_tokens": self.args.max_new_tokens, "temperature": 0.0, "ignore_eos": True}}
        r = await self.http.post(self.url + "/generate", json=body)
        r.raise_for_status()
        out = r.json()
        # the simulator decodes deterministically: make each sample's output its own
        ids = [int(t) for t in out.get("output_ids") or []]
        return [(t + self.rng.randrange(1, 97)) % 30000 + 100 for t in ids], \
            (out.get("meta_info") or {}).get("cached_tokens")

    async def run(self) -> None:
        try:
            for t in range(self.args.turns):
                t0 = time.monotonic()
                async with self.gate.turn(self.sid, prompt_ids=self.history, max_new_tokens=self.args.max_new_tokens,
                                          turn_index=t, **self.share) as lease:
                    out, cached = await self.generate()
                say(f"{self.sid} turn {t}: {lease.outcome}/{lease.reason or '-'} waited={lease.waited_s:.2f}s "
                    f"latency={time.monotonic() - t0:.2f}s prompt={len(self.history)} cached={cached}")
                self.stats["outcomes"][f"{lease.outcome}/{lease.reason or '-'}"] += 1
                self.stats["turns"] += 1
                if t == 0 and cached is not None:
                    self.stats["first_turn_cached"] += cached
                self.history += out
                if t + 1 < self.args.turns:
                    await asyncio.sleep(min(5.0, self.rng.lognormvariate(0.0, 0.8) * self.args.tool_pause_s))
                    self.history += tokens(self.rng, self.args.tool_tokens)
        finally:
            await self.gate.finish_session(self.sid)
            self.stats["finished"] += 1


async def amain(args: argparse.Namespace) -> int:
    t_start = time.monotonic()
    with contextlib.ExitStack() as stack:
        redis_url = args.redis or stack.enter_context(private_redis())
        from kvgate.tools.sim import SimCluster

        sim = SimCluster(1, "gpu-h100-30b", time_scale=args.sim_time_scale, kv_capacity_tokens=args.sim_kv_tokens)
        await asyncio.to_thread(sim.start)
        stack.callback(sim.stop)
        url = sim.router_url
        say(f"started the SGLang SIMULATOR: router {url}, one engine of {args.sim_kv_tokens} KV tokens")
        cfg = kvgate.GateConfig.from_env(base=kvgate.GateConfig(**EXAMPLE_KNOBS))
        start_poller(stack, stack.enter_context(kvgate.Gate.from_url(redis_url, gate=args.gate, config=cfg)),
                     router=url)

        async with kvgate.AsyncGate.from_url(redis_url, gate=args.gate, config=cfg) as gate, \
                httpx.AsyncClient(timeout=30.0, trust_env=False) as http:
            st = await wait_fresh(gate, 15.0)
            say(f"gate {args.gate!r}: ceiling={st['ceiling']} degraded={st['degraded']}; sharing "
                f"{'off' if args.no_share else 'on'}")
            rng = random.Random(args.seed)
            system = tokens(rng, args.system_tokens)
            stats: dict = {"outcomes": Counter(), "turns": 0, "finished": 0, "first_turn_cached": 0}
            samples = []
            for task in range(args.tasks):
                prompt = system + tokens(rng, args.task_tokens)
                samples += [Sample(task, k, prompt, gate, http, url, args, stats)
                            for k in range(args.samples)]
            try:
                await asyncio.wait_for(asyncio.gather(*(s.run() for s in samples)), args.timeout_s)
            except asyncio.TimeoutError:
                say(f"run deadline of {args.timeout_s:.0f}s reached: remaining samples were cancelled")
            await gate.housekeep()
            st = await gate.status()
            m = await gate.step_metrics(drain=True)
        sharing = {k.split("/")[-1]: v for k, v in m.items() if k.startswith("agentic_kv/sharing/")}
        say("sharing: " + ", ".join(f"{k}={v:g}" for k, v in sorted(sharing.items())))
        n = args.tasks * args.samples
        ok = stats["turns"] == n * args.turns and stats["finished"] == n
        say("RESULT " + json.dumps({
            "ok": ok, "seconds": round(time.monotonic() - t_start, 2), "turns": stats["turns"],
            "expected_turns": n * args.turns, "finished_samples": stats["finished"], "shared": not args.no_share,
            "outcomes": dict(stats["outcomes"]), "sharing": sharing,
            "first_turn_cached_tokens": stats["first_turn_cached"],
            "status": {k: st[k] for k in ("reserved", "leases", "windows", "waiting", "degraded", "prefixes")}}))
        return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    for name in ("tasks", "samples", "turns", "task_tokens", "max_new_tokens", "sim_kv_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.system_tokens < 0 or args.tool_tokens < 0 or args.tool_pause_s < 0 or args.timeout_s <= 0:
        p.error("--system-tokens, --tool-tokens and --tool-pause-s must be >= 0; --timeout-s > 0")
    return asyncio.run(amain(args))


if __name__ == "__main__":
    sys.exit(main())
