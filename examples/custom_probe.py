#!/usr/bin/env python3
"""Implementing kvgate's residency-probe interface, and watching the gate use it.

A residency probe answers one question: *what fraction of this prompt's leading blocks is in the
prefix cache right now?*  kvgate asks it only when the cheap rules did not decide a turn (usage
between ``high_watermark`` and ``pressure_threshold``, no ownership window), so it may cost a
little, but it must not queue, allocate or run anything.  The interface (``kvgate.client.probe``)::

    class ResidencyProbe(Protocol):               # sync; AsyncGate runs it in a thread
        def probe(self, session_id: str, prompt_ids: Sequence[int]) -> ProbeResult: ...
    class AsyncResidencyProbe(Protocol):          # AsyncGate prefers aprobe when present
        async def aprobe(self, session_id: str, prompt_ids: Sequence[int]) -> ProbeResult: ...

``ProbeResult(hit_ratio=None)`` means "unavailable"; raising, returning garbage or exceeding
``probe_timeout_s`` count as unavailable too.  kvgate ships two probes (the vLLM plugin's
``HttpProbe`` / ``InProcessVllmProbe``); this file builds a third kind with no engine access at all:
a client-side *shadow* of the prefix cache (chained block hashes of what this client sent,
LRU-bounded), which is what you can do when the engine has no probe endpoint (SGLang).

No engines are needed: the script plays the poller itself with ``gate.write_snapshot`` and walks
through the decisions the probe drives:

1. usage 0.30 (below high_watermark): ``open``; the probe is not even called;
2. usage 0.88 (between the bands): a session whose prefix is resident -> ``resident_prefix``
   (and it now owns an ownership window); a cold session waits (``cold_prefix``) until usage
   drops, then enters ``open`` after its wait;
3. usage 0.95 (above pressure_threshold): the window owner still enters (``reserved_session``);
4. residency without admission and a probe that fails -> ``prefix_probe_unavailable`` (fail open).

    python examples/custom_probe.py                      # private redis-server
    python examples/custom_probe.py --redis redis://127.0.0.1:6379/0
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import random
import sys
import threading
from collections import OrderedDict
from typing import Sequence

import kvgate
from kvgate import EngineState, ProbeResult
from _support import private_redis, say  # examples/_support.py


class ShadowPrefixProbe:
    """A client-side model of the engines' prefix caches.

    ``observe(tokens)`` records the chained hashes of every full block of a sequence the engine
    has processed (prompt + output); ``probe`` counts how many leading full blocks of a prompt are
    recorded.  Bounded: at most ``capacity_blocks`` hashes, least recently observed evicted first,
    roughly like the engine's own LRU.  ``probe`` is read-only (it does not refresh LRU order).
    Thread-safe: the sync Gate calls probes from a small thread pool.
    """

    def __init__(self, block_size: int = 16, capacity_blocks: int = 65536):
        if block_size < 1 or capacity_blocks < 1:
            raise ValueError("block_size and capacity_blocks must be >= 1")
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()
        self.calls = 0

    def _hashes(self, tokens: Sequence[int]):
        parent = b"kvgate-shadow"
        bs = self.block_size
        for i in range(0, len(tokens) - len(tokens) % bs, bs):
            h = hashlib.blake2b(parent + b",".join(str(t).encode() for t in tokens[i:i + bs]), digest_size=16)
            parent = h.digest()
            yield parent

    def observe(self, tokens: Sequence[int]) -> None:
        with self._lock:
            for h in self._hashes(tokens):
                self._blocks[h] = None
                self._blocks.move_to_end(h)
            while len(self._blocks) > self.capacity_blocks:
                self._blocks.popitem(last=False)

    def forget(self) -> None:
        with self._lock:
            self._blocks.clear()

    # -- the ResidencyProbe interface ---------------------------------------------------------
    def probe(self, session_id: str, prompt_ids: Sequence[int]) -> ProbeResult:
        self.calls += 1
        total = len(prompt_ids)
        if total == 0:
            return ProbeResult(None, detail="empty prompt")
        hit_blocks = 0
        with self._lock:
            for h in self._hashes(prompt_ids):
                if h not in self._blocks:
                    break  # hashes are chained: nothing after a miss can hit
                hit_blocks += 1
        cached = hit_blocks * self.block_size
        return ProbeResult(hit_ratio=cached / total, cached_tokens=cached, total_tokens=total,
                           cached_blocks=hit_blocks, detail="client-side shadow cache")


class BrokenProbe:
    """A probe whose backend is down: every call raises.  The gate treats it as unavailable."""

    def probe(self, session_id: str, prompt_ids: Sequence[int]) -> ProbeResult:
        raise ConnectionError("probe backend unreachable")


def snapshot(gate: kvgate.Gate, usage: float) -> None:
    """Play the poller: one engine with 100k KV tokens at the given usage."""
    gate.write_snapshot([EngineState(engine_id="engine-0", capacity_tokens=100_000, usage=usage,
                                     url="http://engine-0.invalid:30000", kind="sglang")])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="custom_probe.py", description=__doc__.split("\n")[0])
    ap.add_argument("--redis", metavar="URL", default=None, help="Redis URL (default: a private redis-server)")
    ap.add_argument("--gate", default="probe-example")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    steps: list[dict] = []

    def record(step: str, lease, expect: str) -> None:
        got = f"{lease.outcome}/{lease.reason}"
        steps.append({"step": step, "outcome": lease.outcome, "reason": lease.reason,
                      "waited_s": round(lease.waited_s, 3), "expected": expect})
        say(f"{step:<44} -> {got:<34} waited={lease.waited_s:.2f}s  (expected {expect})")

    # staleness 60 s: this script writes snapshots by hand, not every second like a poller
    cfg = kvgate.GateConfig(max_wait_s=5.0, wait_poll_s=0.2, idle_grace_s=10.0, staleness_s=60.0)
    with contextlib.ExitStack() as stack:
        url = args.redis or stack.enter_context(private_redis())
        probe = ShadowPrefixProbe(block_size=16)
        gate = stack.enter_context(kvgate.Gate.from_url(url, gate=args.gate, config=cfg, probe=probe))
        max_new = 64

        def tokens(n: int) -> list[int]:
            return [rng.randrange(100, 30000) for _ in range(n)]

        # 1. low usage: the ledger alone decides; the probe is not consulted. This turn does not
        #    ask to keep its place (retain_session=False), so it opens no ownership window and
        #    the next turn has to show its prefix is resident.
        snapshot(gate, 0.30)
        warm = tokens(2000)
        with gate.turn("warm", prompt_ids=warm, max_new_tokens=max_new, retain_session=False) as lease:
            output = tokens(max_new)                 # stands in for the engine call
            record("1. usage 0.30, warm turn 0", lease, "admit/open")
        probe.observe(warm + output)                 # the engine now holds prompt + output
        say(f"   probe calls so far: {probe.calls}")

        # 2. between high_watermark (0.85) and pressure_threshold (0.92)
        snapshot(gate, 0.88)
        warm = warm + output + tokens(200)           # next turn: history + tool result
        say(f"   probe says for warm turn 1: {probe.probe('warm', warm)}")
        with gate.turn("warm", prompt_ids=warm, max_new_tokens=max_new) as lease:
            output = tokens(max_new)
            record("2a. usage 0.88, warm turn 1 (prefix resident)", lease, "admit/resident_prefix")
        probe.observe(warm + output)
        st = gate.status()
        say(f"   after release: windows={st['windows']} reserved={st['reserved']} (warm keeps its reservation "
            f"for idle_grace_s={cfg.idle_grace_s:g}s)")

        cold = tokens(3000)
        say(f"   probe says for cold turn 0: {probe.probe('cold', cold)}")
        relief = threading.Timer(1.0, snapshot, args=(gate, 0.50))   # pressure drops after 1 s
        relief.start()
        stack.callback(relief.cancel)
        with gate.turn("cold", prompt_ids=cold, max_new_tokens=max_new) as lease:
            record("2b. usage 0.88, cold turn 0 (waits: cold_prefix)", lease, "admit/open after a wait")
        relief.join(5)
        waits = gate.step_metrics(drain=False)
        say(f"   why it waited: wait_cold_prefix={waits.get('agentic_kv/admission/wait_cold_prefix', 0):g} "
            f"(step metrics)")

        # 3. above pressure_threshold: only ownership windows enter
        snapshot(gate, 0.95)
        warm = warm + output + tokens(200)
        with gate.turn("warm", prompt_ids=warm, max_new_tokens=max_new) as lease:
            record("3. usage 0.95, warm turn 2 (owns a window)", lease, "admit/reserved_session")

        for sid in ("warm", "cold"):
            gate.finish_session(sid)
        final = gate.status()

        # 4. residency only (admission off) with a failing probe: fail open
        cfg4 = cfg.replace(admission=False)
        gate4 = stack.enter_context(kvgate.Gate.from_url(url, gate=args.gate + "-broken", config=cfg4,
                                                         probe=BrokenProbe()))
        snapshot(gate4, 0.88)
        with gate4.turn("any", prompt_ids=tokens(1000), max_new_tokens=max_new) as lease:
            record("4. residency only, probe raises", lease, "admit/prefix_probe_unavailable")
        gate4.finish_session("any")
        final4 = gate4.status()

    say(f"gate status: reserved={final['reserved']} leases={final['leases']} windows={final['windows']} "
        f"waiting={final['waiting']}; {args.gate}-broken reserved={final4['reserved']}")
    say("RESULT " + json.dumps({"steps": steps, "probe_calls": probe.calls,
                                "wait_cold_prefix": waits.get("agentic_kv/admission/wait_cold_prefix", 0),
                                "status": {k: final[k] for k in ("reserved", "leases", "windows", "waiting")},
                                "status_broken": {k: final4[k] for k in ("reserved", "leases", "windows")}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
