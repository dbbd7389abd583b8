"""Residency-probe latency against a real CPU vLLM engine (run under the vLLM venv).

    .venv-vllm/bin/python benchmarks/probe_latency.py [--n 200] [--lengths 128,512,2048,8192]

Three ways to ask the same question ("how many leading blocks of this prompt are cached?"):

  direct   LLM with VLLM_ENABLE_V1_MULTIPROCESSING=0: EngineCore lives in this process, the probe calls
           the plugin's method directly (InProcessVllmProbe.probe)
  utility  AsyncLLM (EngineCore in its own process): one UTILITY call over ZMQ (InProcessVllmProbe.aprobe)
  http     the OpenAI server's POST /kvgate/probe route (HttpProbe.probe, one engine)
  busy     the same route while two client threads keep the engine decoding (back-to-back
           256-token completions), plus GET /health on the same server as a control: a slow
           /health means the API server itself is not answering, whatever the route

For each prompt length it serves the prompt once (so its full blocks are cached), then probes it
`--n` times ("hit": every block is hashed and found) and probes a cold prompt of the same length
`--n` times ("miss": hashing stops after the first chunk), and prints p50 / p99 in milliseconds.
Every engine is idle while probed in the first three modes.  `max_ms` and `over_0.5s` (probes slower
than the gate's default probe_timeout_s) matter most for `busy`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time

NUM_BLOCKS = 600
BLOCK = 32


def toks(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summarize(mode: str, length: int, kind: str, secs: list[float], cached_blocks: int) -> dict:
    ms = [s * 1e3 for s in secs]
    return {"mode": mode, "tokens": length, "case": kind, "n": len(ms), "cached_blocks": cached_blocks,
            "p50_ms": round(pct(ms, 0.50), 3), "p99_ms": round(pct(ms, 0.99), 3),
            "mean_ms": round(statistics.fmean(ms), 3), "max_ms": round(max(ms), 3),
            "over_0.5s": sum(m > 500 for m in ms)}


def bench_sync(mode: str, probe, serve, lengths: list[int], n: int) -> list[dict]:
    rows = []
    for i, length in enumerate(lengths):
        hot, cold = toks(10 + i, length), toks(1000 + i, length)
        serve(hot)
        for kind, ids in (("hit", hot), ("miss", cold)):
            for _ in range(min(10, n)):  # warm-up
                probe.probe("bench", ids)
            secs, last = [], None
            for _ in range(n):
                t = time.perf_counter()
                last = probe.probe("bench", ids)
                secs.append(time.perf_counter() - t)
            assert last.hit_ratio is not None, last.detail
            rows.append(summarize(mode, length, kind, secs, last.cached_blocks))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def run_direct(model_dir: str, lengths: list[int], n: int, max_len: int) -> list[dict]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvgate.integrations.vllm import InProcessVllmProbe
    from kvgate.tools.vllm_testing import engine_kwargs

    llm = LLM(**engine_kwargs(model_dir, num_blocks=NUM_BLOCKS, block_size=BLOCK, max_model_len=max_len))
    try:
        probe = InProcessVllmProbe(llm, timeout_s=5.0)
        assert probe.mode == "direct", probe.mode
        sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        return bench_sync("direct", probe, lambda ids: llm.generate([TokensPrompt(prompt_token_ids=ids)], sp,
                                                                    use_tqdm=False), lengths, n)
    finally:
        llm.llm_engine.engine_core.shutdown()
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)


def run_utility(model_dir: str, lengths: list[int], n: int, max_len: int) -> list[dict]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    from kvgate.integrations.vllm import InProcessVllmProbe
    from kvgate.tools.vllm_testing import engine_kwargs

    async def main() -> list[dict]:
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_kwargs(
            model_dir, num_blocks=NUM_BLOCKS, block_size=BLOCK, max_model_len=max_len)))
        rows = []
        try:
            probe = InProcessVllmProbe(engine, timeout_s=5.0)
            sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
            for i, length in enumerate(lengths):
                hot, cold = toks(10 + i, length), toks(1000 + i, length)
                async for _ in engine.generate(TokensPrompt(prompt_token_ids=hot), sp, request_id=f"w{i}"):
                    pass
                for kind, ids in (("hit", hot), ("miss", cold)):
                    for _ in range(min(10, n)):
                        await probe.aprobe("bench", ids)
                    secs, last = [], None
                    for _ in range(n):
                        t = time.perf_counter()
                        last = await probe.aprobe("bench", ids)
                        secs.append(time.perf_counter() - t)
                    assert last.hit_ratio is not None, last.detail
                    rows.append(summarize("utility", length, kind, secs, last.cached_blocks))
                    print(json.dumps(rows[-1]), flush=True)
        finally:
            engine.shutdown()
        return rows

    return asyncio.run(main())


def run_http(model_dir: str, lengths: list[int], n: int, max_len: int) -> list[dict]:
    from kvgate.integrations.http_probe import HttpProbe
    from kvgate.tools.vllm_testing import complete, start_server

    srv = start_server(model_dir, num_blocks=NUM_BLOCKS, block_size=BLOCK, max_model_len=max_len,
                       python=sys.executable)
    try:
        with HttpProbe([srv.url], timeout_s=5.0) as probe:
            return bench_sync("http", probe, lambda ids: complete(srv.url, ids, max_tokens=1), lengths, n)
    finally:
        srv.stop()


def run_busy(model_dir: str, lengths: list[int], n: int, max_len: int) -> list[dict]:
    import threading

    import httpx

    from kvgate.integrations.http_probe import HttpProbe
    from kvgate.tools.vllm_testing import complete, start_server

    srv = start_server(model_dir, num_blocks=NUM_BLOCKS, block_size=BLOCK, max_model_len=max_len,
                       python=sys.executable)
    stop = threading.Event()
    served = [0]

    def decode(seed: int) -> None:
        # one fixed prompt per thread: greedy output repeats, so the background work reuses its own
        # cached blocks instead of evicting the probed prompts
        prompt = toks(seed, 200)
        with httpx.Client(timeout=120.0) as c:
            while not stop.is_set():
                complete(srv.url, prompt, max_tokens=256, client=c)
                served[0] += 1

    class Health:  # GET /health through the same bench loop: the API server's own responsiveness
        def __init__(self) -> None:
            self.c = httpx.Client(base_url=srv.url, timeout=30.0)

        def probe(self, _sid: str, _ids: list[int]):
            self.c.get("/health").raise_for_status()
            return type("R", (), {"hit_ratio": 0.0, "cached_blocks": 0, "detail": ""})()

    threads = [threading.Thread(target=decode, args=(10_000 * (k + 1),), daemon=True) for k in range(2)]
    try:
        for t in threads:
            t.start()
        with HttpProbe([srv.url], timeout_s=30.0) as probe:
            rows = bench_sync("busy", probe, lambda ids: complete(srv.url, ids, max_tokens=1), lengths, n)
        health = bench_sync("health", Health(), lambda ids: None, lengths[:1], n)[:1]  # "hit" half only
        health[0]["tokens"], health[0]["case"] = 0, "-"
        rows += health
        print(f"# busy: {served[0]} background completions of 256 tokens while probing", flush=True)
        return rows
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=130)
        srv.stop()


def table(rows: list[dict]) -> str:
    lines = [f"{'mode':8} {'tokens':>6} {'case':5} {'blocks':>6} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8} "
             f"{'max ms':>8} {'>0.5s':>5}"]
    for r in rows:
        lines.append(f"{r['mode']:8} {r['tokens']:>6} {r['case']:5} {r['cached_blocks']:>6} "
                     f"{r['p50_ms']:>8.3f} {r['p99_ms']:>8.3f} {r['mean_ms']:>8.3f} {r['max_ms']:>8.1f} "
                     f"{r['over_0.5s']:>5}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=200, help="probes per (mode, length, case)")
    ap.add_argument("--lengths", default="128,512,2048,8192", help="prompt lengths in tokens")
    ap.add_argument("--modes", default="http,utility,direct", help="http, utility, busy, direct; direct runs last: its in-process EngineCore freezes vLLM env reads")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.n < 1 or any(L < 1 for L in lengths):
        ap.error("--n and --lengths must be positive")
    if max(lengths) + 16 > (NUM_BLOCKS - 1) * BLOCK:
        ap.error(f"longest prompt must fit the {NUM_BLOCKS}-block cache")
    from kvgate.tools.vllm_testing import write_model
    model_dir = write_model(max_position=max(4096, max(lengths) + 64))
    max_len = max(2048, max(lengths) + 16)
    runners = {"direct": run_direct, "utility": run_utility, "http": run_http, "busy": run_busy}
    rows: list[dict] = []
    for mode in args.modes.split(","):
        if mode not in runners:
            ap.error(f"unknown mode {mode!r}")
        t = time.monotonic()
        rows += runners[mode](model_dir, lengths, args.n, max_len)
        print(f"# {mode}: {time.monotonic() - t:.0f} s including engine start", flush=True)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
