"""How much a bf16 matmul slows down as oneDNN is capped to older instruction sets.

The real CPU vLLM engine computes in bfloat16. Boxes of this project's one machine kind
prefilled the heavy dummy model at anything from 0.07 to 3.6 ms per token
(docs/benchmarks.md#cpu-isa); this shows how much of that the CPU's matrix instructions can
explain on one box: each level runs in its own process with ``ONEDNN_MAX_CPU_ISA`` set, side by
side, and is reported as a ratio to this CPU's own best. Needs PyTorch (the vLLM venv has it):

    .venv-vllm/bin/python benchmarks/cpu_isa_matmul.py
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

LEVELS = ("native", "AVX512_CORE_AMX", "AVX512_CORE_BF16", "AVX512_CORE", "AVX2")

CHILD = """
import sys, time, torch
m, k, n, reps = map(int, sys.argv[1:5])
torch.manual_seed(0)
x = torch.randn(m, k, dtype=torch.bfloat16)
w = torch.randn(n, k, dtype=torch.bfloat16)
for _ in range(3):
    torch.nn.functional.linear(x, w)
t = time.perf_counter()
for _ in range(reps):
    torch.nn.functional.linear(x, w)
print((time.perf_counter() - t) / reps)
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="1024,512,1536",
                   help="M,K,N: tokens x hidden -> out (default: a prefill chunk through the heavy model's MLP)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3, help="levels interleaved, median per level")
    a = p.parse_args()
    try:
        m, k, n = (int(x) for x in a.shape.split(","))
    except ValueError:
        p.error(f"--shape must be M,K,N integers, got {a.shape!r}")
    if min(m, k, n, a.reps, a.rounds) <= 0:
        p.error("--shape, --reps and --rounds must be positive")
    times: dict[str, list[float]] = {lv: [] for lv in LEVELS}
    for _ in range(a.rounds):
        for lv in LEVELS:
            env = {key: v for key, v in os.environ.items() if key != "ONEDNN_MAX_CPU_ISA"}
            if lv != "native":
                env["ONEDNN_MAX_CPU_ISA"] = lv
            r = subprocess.run([sys.executable, "-c", CHILD, str(m), str(k), str(n), str(a.reps)],
                               capture_output=True, text=True, env=env, timeout=600)
            if r.returncode:
                print(r.stderr, file=sys.stderr)
                return 1
            times[lv].append(float(r.stdout.strip().splitlines()[-1]))
    med = {lv: statistics.median_high(t) for lv, t in times.items()}
    print(f"bf16 linear {m}x{k} -> {n}, median of {a.rounds} rounds x {a.reps} calls, {os.cpu_count()} CPUs")
    for lv in LEVELS:
        print(f"  ONEDNN_MAX_CPU_ISA={lv:<17} {med[lv] * 1e3:8.3f} ms  {med[lv] / med['native']:6.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
