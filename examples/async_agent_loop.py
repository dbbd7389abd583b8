#!/usr/bin/env python3
"""An asyncio agent loop with ``kvgate.AsyncGate``: many sessions, tool pauses, a deadline per
turn, ``finish_session`` at the end of each session.

Each agent session is one asyncio task::

    async with gate.turn(session_id, prompt_ids=history, max_new_tokens=n) as lease:
        out = await engine.generate(history)        # the lease is held only around the engine call
    history += out + await tool(...)                # tool pause OUTSIDE the lease
    ...
    await gate.finish_session(session_id)          # ends its ownership window (and, with the
                                                   # session lifecycle, closes its KV on every engine)

A turn that takes longer than ``--turn-deadline-s`` (waiting in the gate or generating) is
cancelled with ``asyncio.wait_for``: a waiting attempt leaves the FIFO atomically, a lease granted
at that instant is released, never leaked; the agent then retries the turn with a new attempt.
``kvgate.Preempted`` (a newer attempt of the same session superseded a waiting one) is handled
the same way.

By default it starts a private redis-server and kvgate's SGLang SIMULATOR (``SimCluster``) with a
small KV pool, and a ``Poller`` in a thread that writes the capacity snapshots.  Give
``--redis URL`` / ``--router URL`` to use your own (SGLang ``/generate`` API).

    python examples/async_agent_loop.py
    python examples/async_agent_loop.py --sessions 16 --turns 6 --turn-deadline-s 2

Prints one line per turn, the gate status, the step metrics and a ``RESULT {json}`` line.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from collections import Counter, defaultdict

import httpx

import kvgate
from _support import private_redis, say, start_poller, wait_fresh  # examples/_support.py

EXAMPLE_KNOBS = dict(max_wait_s=5.0, wait_poll_s=0.5, idle_grace_s=10.0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="async_agent_loop.py", description="asyncio agent loop with kvgate.AsyncGate")
    p.add_argument("--redis", metavar="URL", default=None, help="Redis URL (default: a private redis-server)")
    p.add_argument("--gate", default="async-example")
    p.add_argument("--router", metavar="URL", default=None,
                   help="SGLang router / engine base URL (default: a private simulator); its poller must "
                        "run elsewhere unless --poller")
    p.add_argument("--poller", action=argparse.BooleanOptionalAction, default=None,
                   help="run a Poller in this process (default: on with the private simulator)")
    p.add_argument("--session-lifecycle", action=argparse.BooleanOptionalAction, default=False,
                   help="send session_id on /generate and /close_session at finish "
                        "(SGLang --enable-session-radix-cache; the simulator models it)")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--first-prompt", type=int, default=2500)
    p.add_argument("--tool-tokens", type=int, default=250)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--tool-pause-s", type=float, default=0.2, help="median tool pause (lognormal)")
    p.add_argument("--turn-deadline-s", type=float, default=8.0,
                   help="cancel a turn (gate wait + generation) after this long, then retry it")
    p.add_argument("--max-attempts", type=int, default=3, help="attempts per turn before giving up on it")
    p.add_argument("--sim-kv-tokens", type=int, default=8192)
    p.add_argument("--sim-time-scale", type=float, default=0.2)
    p.add_argument("--timeout-s", type=float, default=60.0, help="bound on the whole run")
    p.add_argument("--seed", type=int, default=0)
    return p


class Agent:
    """One agent program: a growing token history, a model call per turn, a tool between turns."""

    def __init__(self, sid: str, gate: kvgate.AsyncGate, http: httpx.AsyncClient, url: str,
                 args: argparse.Namespace, stats: dict):
        self.sid, self.gate, self.http, self.url, self.args, self.stats = sid, gate, http, url, args, stats
        self.rng = random.Random(f"{args.seed}/{sid}")
        self.history = [self.rng.randrange(100, 30000) for _ in range(args.first_prompt)]

    async def generate(self) -> tuple[list[int], int | None]:
        body = {"input_ids": self.history, "session_id": self.sid,
                "sampling_params": {"max_new_tokens": self.args.max_new_tokens, "temperature": 0.0,
                                    "ignore_eos": True}}
        r = await self.http.post(self.url + "/generate", json=body)
        r.raise_for_status()
        out = r.json()
        return [int(t) for t in out.get("output_ids") or []], (out.get("meta_info") or {}).get("cached_tokens")

    async def tool(self) -> list[int]:
        await asyncio.sleep(min(5.0, self.rng.lognormvariate(0.0, 0.8) * self.args.tool_pause_s))
        return [self.rng.randrange(100, 30000) for _ in range(self.args.tool_tokens)]

    async def one_turn(self, t: int) -> bool:
        """Run turn ``t`` with retries; True when the engine answered."""
        for attempt in range(1, self.args.max_attempts + 1):
            t0 = time.monotonic()
            held: dict = {}

            async def attempt_once() -> tuple:
                async with self.gate.turn(self.sid, prompt_ids=self.history,
                                          max_new_tokens=self.args.max_new_tokens, turn_index=t) as lease:
                    held["lease"] = lease
                    out, cached = await self.generate()
                return lease, out, cached

            try:
                lease, out, cached = await asyncio.wait_for(attempt_once(), self.args.turn_deadline_s)
            except asyncio.TimeoutError:
                lease = held.get("lease")
                what = "waiting in the gate" if lease is None else f"generating ({lease.outcome}/{lease.reason})"
                then = "retrying" if attempt < self.args.max_attempts else "giving up on the session"
                say(f"{self.sid} turn {t} attempt {attempt}: CANCELLED after {self.args.turn_deadline_s:.1f}s "
                    f"{what}; {then}")
                self.stats["outcomes"]["cancelled"] += 1
                continue
            except kvgate.Preempted:
                say(f"{self.sid} turn {t} attempt {attempt}: preempted by a newer attempt")
                self.stats["outcomes"]["preempted"] += 1
                continue
            except httpx.HTTPError as e:
                say(f"{self.sid} turn {t} attempt {attempt}: engine error {type(e).__name__}: {e}")
                self.stats["outcomes"]["engine_error"] += 1
                continue
            dt = time.monotonic() - t0
            say(f"{self.sid} turn {t}: {lease.outcome}/{lease.reason or '-'} waited={lease.waited_s:.2f}s "
                f"latency={dt:.2f}s prompt={len(self.history)} cached={cached}")
            self.stats["outcomes"][f"{lease.outcome}/{lease.reason or '-'}"] += 1
            self.stats["latency_by_turn"][t].append(dt)
            self.stats["turns"] += 1
            self.history += out
            return True
        self.stats["failed_turns"] += 1
        return False

    async def run(self) -> None:
        try:
            for t in range(self.args.turns):
                if not await self.one_turn(t):
                    break
                if t + 1 < self.args.turns:
                    self.history += await self.tool()     # no lease is held during the tool call
        finally:
            res = await self.gate.finish_session(self.sid)
            self.stats["finished"] += 1
            if "close" in res:
                self.stats["close_failures"] += res["close"]["failures"]


async def amain(args: argparse.Namespace) -> int:
    t_start = time.monotonic()
    with contextlib.ExitStack() as stack:
        redis_url = args.redis or stack.enter_context(private_redis())
        url = args.router
        if url is None:
            from kvgate.tools.sim import SimCluster
            sim = SimCluster(2, "gpu-h100-30b", time_scale=args.sim_time_scale,
                             session_radix_cache=args.session_lifecycle, kv_capacity_tokens=args.sim_kv_tokens)
            await asyncio.to_thread(sim.start)          # the simulator runs on its own thread and loop
            stack.callback(sim.stop)
            url = sim.router_url
            say(f"started the SGLang SIMULATOR: router {url}, engines {sim.engine_urls}")
        cfg = kvgate.GateConfig.from_env(base=kvgate.GateConfig(**EXAMPLE_KNOBS),
                                         session_lifecycle=args.session_lifecycle or None)
        run_poller = args.poller if args.poller is not None else args.router is None
        if run_poller:
            # The poller is synchronous (its own event loop): run it on a thread with a sync Gate.
            pgate = stack.enter_context(kvgate.Gate.from_url(redis_url, gate=args.gate, config=cfg))
            start_poller(stack, pgate, router=url)

        async with kvgate.AsyncGate.from_url(redis_url, gate=args.gate, config=cfg) as gate, \
                httpx.AsyncClient(timeout=30.0, trust_env=False) as http:
            st = await wait_fresh(gate, 15.0)
            say(f"gate {args.gate!r}: ceiling={st['ceiling']} usage={st['usage']:.3f} degraded={st['degraded']}")
            stats: dict = {"outcomes": Counter(), "latency_by_turn": defaultdict(list), "turns": 0,
                           "failed_turns": 0, "finished": 0, "close_failures": 0}
            agents = [Agent(f"agent-{i}", gate, http, url, args, stats) for i in range(args.sessions)]
            try:
                await asyncio.wait_for(asyncio.gather(*(a.run() for a in agents)), args.timeout_s)
            except asyncio.TimeoutError:
                say(f"run deadline of {args.timeout_s:.0f}s reached: remaining sessions were cancelled")
            await gate.housekeep()
            st = await gate.status()
            metrics = await gate.step_metrics(drain=True)
        say(f"gate status: reserved={st['reserved']} leases={st['leases']} windows={st['windows']} "
            f"waiting={st['waiting']} usage={st['usage']:.3f}")
        say("step metrics: " + ", ".join(f"{k}={v:g}" for k, v in sorted(metrics.items())
                                         if k.startswith("agentic_kv/admission/")))
        lat = {t: round(sum(v) / len(v), 3) for t, v in sorted(stats["latency_by_turn"].items())}
        ok = stats["turns"] == args.sessions * args.turns and stats["finished"] == args.sessions
        say("RESULT " + json.dumps({
            "ok": ok, "seconds": round(time.monotonic() - t_start, 2), "turns": stats["turns"],
            "expected_turns": args.sessions * args.turns, "failed_turns": stats["failed_turns"],
            "finished_sessions": stats["finished"], "outcomes": dict(stats["outcomes"]),
            "mean_latency_by_turn_s": lat, "close_failures": stats["close_failures"],
            "status": {k: st[k] for k in ("reserved", "leases", "windows", "waiting", "degraded")}}))
        return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    for name in ("sessions", "turns", "first_prompt", "max_new_tokens", "max_attempts", "sim_kv_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.turn_deadline_s <= 0 or args.timeout_s <= 0 or args.tool_pause_s < 0 or args.tool_tokens < 0:
        p.error("--turn-deadline-s and --timeout-s must be > 0; --tool-pause-s and --tool-tokens >= 0")
    return asyncio.run(amain(args))


if __name__ == "__main__":
    sys.exit(main())
