"""Run ``kvgate bench`` against a real CPU vLLM server (dummy weights, 80-block prefix cache).

Starts one OpenAI server with the kvgate plugin (``/kvgate/probe``, ``/kvgate/usage``) from the
vLLM venv, runs the bench against it (no gate, the fixed-cap sweep, widened while its best cap is
at its edge, and kvgate with default knobs: the same seeded workload, the prefix cache reset
between policies through ``POST /reset_prefix_cache``), prints the same check as every scenario
(kvgate at most 1.05x the better of no gate and the best per-session cap), and stops the server
by its process group.

    python3 benchmarks/real_vllm.py --model heavy --out bench-out/real-vllm/heavy [-- extra bench args]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from kvgate.tools.bench.flags import MATRIX_POLICIES
from kvgate.tools.bench.host import MATRIX_ISA_LEVELS
from kvgate.tools.bench.host import describe as describe_host
from kvgate.tools.vllm_testing import DEFAULT_VLLM_PYTHON, start_server, write_model

# --cpu-isa: what an older CPU lacks, hidden from PyTorch and vLLM (cpu_isa/sitecustomize.py) and
# capped in oneDNN and ATen. Why: docs/benchmarks.md#cpu-isa.
CPU_ISA = {
    "native": ("", {}),
    "avx512_bf16": ("amx_*", {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}),
    "avx512": ("amx_*,avx512_bf16,avx512_fp16,avx512_vnni,avx_vnni*", {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}),
    "avx2": ("amx_*,avx512*,avx_vnni*", {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}),
}


def isa_env(isa: str) -> dict[str, str]:
    """Environment for a vLLM server that should see only ``isa`` of this CPU (empty for native)."""
    if isa not in CPU_ISA:
        raise ValueError(f"--cpu-isa must be one of {', '.join(CPU_ISA)}, got {isa!r}")
    mask, caps = CPU_ISA[isa]
    if not mask:
        return {}
    shim = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_isa")
    path = os.pathsep.join(x for x in (shim, os.environ.get("PYTHONPATH", "")) if x)
    return {"PYTHONPATH": path, "KVGATE_CPU_MASK": mask, **caps}


# low to high ("native" is the host's own level)
ISA_ORDER = tuple(name for name, _ in reversed(MATRIX_ISA_LEVELS))


def effective_isa(cpu_isa: str, host_isa: str) -> str:
    """The matrix level the server computed at: the host's own under ``native``, else the
    lower of the emulated level and the host's (hiding AMX on an AVX2 box changes nothing).
    Where the host's level is not known, the emulated one (an upper bound)."""
    if cpu_isa == "native":
        return host_isa
    if host_isa in ISA_ORDER:
        return min(cpu_isa, host_isa, key=ISA_ORDER.index)
    return cpu_isa


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("tiny", "heavy"), default="heavy",
                   help="tiny: hidden 128, 2 layers; heavy: hidden 512, 4 layers (dummy weights)")
    p.add_argument("--venv-python", default=DEFAULT_VLLM_PYTHON)
    p.add_argument("--num-blocks", type=int, default=80)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--out", default=None)
    p.add_argument("--cpu-isa", choices=tuple(CPU_ISA), default=os.environ.get("CPU_ISA", "native"),
                   help="emulate an older CPU for the server: hide AMX (avx512_bf16), also AVX512-BF16 "
                        "(avx512), or all of AVX-512 (avx2); default native, or $CPU_ISA")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="extra kvgate bench arguments after --")
    a = p.parse_args()
    try:
        server_env = {"VLLM_SERVER_DEV_MODE": "1", **isa_env(a.cpu_isa)}
    except ValueError as e:  # $CPU_ISA is not checked by argparse's choices
        print(f"real_vllm.py: error: {e}", file=sys.stderr)
        return 2
    if not os.path.exists(a.venv_python):
        print(f"vLLM python not found: {a.venv_python} (build it with scripts/setup-vllm-cpu.sh)", file=sys.stderr)
        return 2
    from kvgate.tools.bench import cli as bench_cli

    rest = [x for x in a.rest if x != "--"]
    # the caps come from the server's pool (/kvgate/usage) and widen; a --policies in `rest`
    # comes later and wins
    argv = ["--engine", "http://127.0.0.1:1", "--engine-kind", "vllm", "--scenario", f"cpu-{a.model}",
            "--vocab", "1000", "--policies", MATRIX_POLICIES, "--out", a.out or f"bench-out/real-vllm/{a.model}",
            *rest]
    err = bench_cli.check_args(argv)  # before the ~25 s server start: a typo fails now
    if err:
        print(f"kvgate bench: error: {err}", file=sys.stderr)
        return 2
    heavy = a.model == "heavy"
    model_dir = write_model(heavy=heavy)
    srv = start_server(model_dir, heavy=heavy, num_blocks=a.num_blocks, block_size=a.block_size,
                       python=a.venv_python, env=server_env, wait_s=300)
    try:
        argv[1] = srv.url
        isa = "" if a.cpu_isa == "native" else f"  (server with --cpu-isa {a.cpu_isa}: an emulated older CPU)"
        print("kvgate bench " + " ".join(argv) + isa, flush=True)
        started = time.time()
        rc = bench_cli.main(argv)
    finally:
        srv.stop()
    note_server(os.path.join(bench_cli.build_parser().parse_args(argv).out, "bench.json"), {
        "model": a.model, "num_blocks": a.num_blocks, "block_size": a.block_size, "cpu_isa": a.cpu_isa,
        "matrix_isa": effective_isa(a.cpu_isa, describe_host()["matrix_isa"])},
        written_after=started)
    return rc


def note_server(path: str, server: dict, written_after: float = 0.0) -> None:
    """Record the server this wrapper started in the bench's JSON (the bench sees only its URL).
    A file older than ``written_after`` is an earlier run's, left there when this one failed
    before writing its own: it is not touched."""
    try:
        if os.path.getmtime(path) < written_after:
            return
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return  # the bench failed before writing it; its own error says why
    doc["vllm_server"] = server
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
