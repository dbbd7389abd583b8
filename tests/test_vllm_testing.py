"""Which interpreter the real-engine benchmarks start vLLM with (no vLLM needed here).

`benchmarks/real_vllm.sh`, `vllm_prefill_cost.py` and the other real-engine scripts start the
server with `kvgate.tools.vllm_testing.DEFAULT_VLLM_PYTHON`. It used to name a venv
under ~/.cache that `scripts/setup-vllm-cpu.sh` never builds (it builds `.venv-vllm` in the
source tree), so the documented "set up, activate, run" path stopped at "vLLM python not found".
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from kvgate.tools.vllm_testing import default_vllm_python

ROOT = Path(__file__).resolve().parents[1]


def _fake_python(venv: Path) -> str:
    py = venv / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text("#!/bin/sh\n")
    py.chmod(0o755)
    return str(py)


def test_explicit_interpreter_wins(monkeypatch, tmp_path):
    monkeypatch.setenv("KVGATE_VLLM_PYTHON", "/opt/somewhere/python")
    monkeypatch.setenv("KVGATE_VLLM_VENV", str(tmp_path))
    assert default_vllm_python() == "/opt/somewhere/python"


def test_the_setup_scripts_venv_when_it_exists(monkeypatch, tmp_path):
    monkeypatch.delenv("KVGATE_VLLM_PYTHON", raising=False)
    monkeypatch.setenv("KVGATE_VLLM_VENV", str(tmp_path / "v"))
    py = _fake_python(tmp_path / "v")
    assert default_vllm_python() == py


def test_the_source_trees_venv_is_what_setup_builds(monkeypatch):
    # the setup script's default venv is <source tree>/.venv-vllm; the default looks there
    monkeypatch.delenv("KVGATE_VLLM_PYTHON", raising=False)
    monkeypatch.delenv("KVGATE_VLLM_VENV", raising=False)
    built = ROOT / ".venv-vllm" / "bin" / "python"
    expected = str(built) if os.access(built, os.X_OK) else sys.executable
    assert default_vllm_python() == expected
    assert '${KVGATE_VLLM_VENV:-$here/.venv-vllm}' in (ROOT / "scripts" / "setup-vllm-cpu.sh").read_text()


def test_no_venv_falls_back_to_this_interpreter(monkeypatch, tmp_path):
    monkeypatch.delenv("KVGATE_VLLM_PYTHON", raising=False)
    monkeypatch.setenv("KVGATE_VLLM_VENV", str(tmp_path / "missing"))
    assert default_vllm_python() == sys.executable
