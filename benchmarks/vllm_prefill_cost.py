"""What a re-prefill costs on the real CPU vLLM engine, from vLLM's own metrics.

Starts one OpenAI server (dummy weights, 80 blocks x 32 tokens, the kvgate plugin), runs
``kvgate bench`` on the ``cpu-<model>`` scenario for each policy given, and prints the deltas
of vLLM's counters over each policy: seconds of prefill per computed (uncached) prompt token
(``vllm:request_prefill_time_seconds_sum / vllm:request_prefill_kv_computed_tokens_sum``) and
seconds of decode per generated token (``vllm:request_decode_time_seconds_sum /
vllm:generation_tokens_total``). Both are per-request times, so concurrent requests overlap.

    python3 benchmarks/vllm_prefill_cost.py --model tiny --policies none,cap-4
"""
from __future__ import annotations

import argparse
import os
import sys

import httpx

from kvgate.tools.vllm_testing import DEFAULT_VLLM_PYTHON, metric_value, start_server, write_model

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from real_vllm import CPU_ISA, isa_env  # noqa: E402 - the sibling script, not a package

SERIES = ("vllm:request_prefill_time_seconds_sum", "vllm:request_prefill_kv_computed_tokens_sum",
          "vllm:request_decode_time_seconds_sum", "vllm:generation_tokens_total",
          "vllm:prompt_tokens_total", "vllm:prefix_cache_hits_total")


def scrape(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {name: metric_value(text, name) for name in SERIES}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("tiny", "heavy"), default="tiny")
    p.add_argument("--policies", default="none,cap-4")
    p.add_argument("--venv-python", default=DEFAULT_VLLM_PYTHON)
    p.add_argument("--out", default="bench-out/prefill-cost")
    p.add_argument("--cpu-isa", choices=tuple(CPU_ISA), default="native",
                   help="emulate an older CPU for the server, as real_vllm.py --cpu-isa")
    a = p.parse_args()
    if not os.path.exists(a.venv_python):
        print(f"vLLM python not found: {a.venv_python} (build it with scripts/setup-vllm-cpu.sh)", file=sys.stderr)
        return 2
    heavy = a.model == "heavy"
    srv = start_server(write_model(heavy=heavy), heavy=heavy, python=a.venv_python,
                       env={"VLLM_SERVER_DEV_MODE": "1", **isa_env(a.cpu_isa)}, wait_s=300)
    try:
        from kvgate.tools.bench import cli as bench_cli
        for pol in a.policies.split(","):
            before = scrape(srv.url)
            rc = bench_cli.main(["--engine", srv.url, "--engine-kind", "vllm", "--scenario", f"cpu-{a.model}",
                                 "--vocab", "1000", "--policies", pol, "--no-plots", "--out", f"{a.out}/{a.model}-{pol}"])
            if rc:
                return rc
            d = {k: v - before.get(k, 0.0) for k, v in scrape(srv.url).items()}
            computed = d["vllm:request_prefill_kv_computed_tokens_sum"]
            gen = d["vllm:generation_tokens_total"]
            print(f"RESULT model={a.model} policy={pol} computed_prompt_tokens={computed:.0f} "
                  f"prefill_ms_per_computed_token={1000 * d['vllm:request_prefill_time_seconds_sum'] / max(computed, 1):.3f} "
                  f"generated_tokens={gen:.0f} "
                  f"decode_ms_per_token={1000 * d['vllm:request_decode_time_seconds_sum'] / max(gen, 1):.3f}",
                  flush=True)
    finally:
        srv.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
