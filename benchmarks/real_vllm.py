"""Run ``kvgate bench`` against a real CPU vLLM server (dummy weights, 80-block prefix cache).

Starts one OpenAI server with the kvgate plugin (``/kvgate/probe``, ``/kvgate/usage``) from the
vLLM venv, runs the bench against it (every policy, the same seeded workload, prefix cache reset
between policies through ``POST /reset_prefix_cache``), and stops the server by its process group.

    python3 benchmarks/real_vllm.py --model heavy --out bench-out/real-vllm/heavy [-- extra bench args]
"""
from __future__ import annotations

import argparse
import os
import sys

from kvgate.integrations.vllm_testing import DEFAULT_VLLM_PYTHON, start_server, write_model


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("tiny", "heavy"), default="heavy",
                   help="tiny: hidden 128, 2 layers; heavy: hidden 512, 4 layers (dummy weights)")
    p.add_argument("--venv-python", default=DEFAULT_VLLM_PYTHON)
    p.add_argument("--num-blocks", type=int, default=80)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--out", default=None)
    p.add_argument("rest", nargs=argparse.REMAINDER, help="extra kvgate bench arguments after --")
    a = p.parse_args()
    if not os.path.exists(a.venv_python):
        print(f"vLLM python not found: {a.venv_python} (build it with scripts/setup-vllm-cpu.sh)", file=sys.stderr)
        return 2
    from kvgate.bench import cli as bench_cli

    rest = [x for x in a.rest if x != "--"]
    argv = ["--engine", "http://127.0.0.1:1", "--engine-kind", "vllm", "--scenario", f"cpu-{a.model}",
            "--vocab", "1000", "--caps", "2,3,4", "--out", a.out or f"bench-out/real-vllm/{a.model}", *rest]
    err = bench_cli.check_args(argv)  # before the ~25 s server start: a typo fails now
    if err:
        print(f"kvgate bench: error: {err}", file=sys.stderr)
        return 2
    heavy = a.model == "heavy"
    model_dir = write_model(heavy=heavy)
    srv = start_server(model_dir, heavy=heavy, num_blocks=a.num_blocks, block_size=a.block_size,
                       python=a.venv_python, env={"VLLM_SERVER_DEV_MODE": "1"}, wait_s=300)
    try:
        argv[1] = srv.url
        print("kvgate bench " + " ".join(argv), flush=True)
        return bench_cli.main(argv)
    finally:
        srv.stop()


if __name__ == "__main__":
    sys.exit(main())
