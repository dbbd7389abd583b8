"""The runtime install: ``pip install kvgate`` with no extras, in a fresh venv, resolves its
dependencies for real and carries the gate, not the lab (no rich, matplotlib, fakeredis,
starlette or uvicorn). Its gate admits and releases a turn on a real redis-server; ``kvgate
status`` prints plain text; ``kvgate bench`` names the extra it needs."""
from __future__ import annotations

import os
import subprocess
import venv
from pathlib import Path

import pytest

from conftest import require_binaries, start_redis

ROOT = Path(__file__).resolve().parents[1]
LAB = ("rich", "matplotlib", "fakeredis", "starlette", "uvicorn")

pytestmark = [pytest.mark.slow, pytest.mark.redis_real, pytest.mark.timeout(900)]

TURN = """
import sys

import kvgate
from kvgate.client.snapshot import EngineState

gate = kvgate.Gate.from_url(sys.argv[1], gate="pkg")
gate.write_snapshot([EngineState(engine_id="e1", capacity_tokens=100_000, used_tokens=0)])
with gate.turn("s1", prompt_ids=list(range(100)), max_new_tokens=10) as lease:
    print(lease.outcome, lease.reason)
st = gate.status()
print("leases after", st["leases"])
gate.finish_session("s1")
# every module outside the tools imports without the lab (vLLM's own modules may be absent)
import importlib, pkgutil
lab = set(sys.argv[2].split(","))
for m in pkgutil.walk_packages(kvgate.__path__, "kvgate."):
    if m.name.startswith("kvgate.tools"):
        continue
    try:
        importlib.import_module(m.name)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] in lab:
            raise
print("lab", sorted({m.split(".")[0] for m in sys.modules} & lab))
"""


def _run(cmd: list, **kw) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, **kw)


def test_the_runtime_install_has_the_gate_and_not_the_lab(tmp_path):
    require_binaries("redis-server")
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    py, kvgate_cmd = env_dir / "bin" / "python", env_dir / "bin" / "kvgate"
    # no extras, no --no-deps: pip resolves redis, httpx and prometheus-client itself
    r = _run([py, "-m", "pip", "install", "-q", str(ROOT)], timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    r = _run([py, "-c", "import importlib.util as u, sys; "
                        "print(','.join(m for m in sys.argv[1].split(',') if u.find_spec(m)))", ",".join(LAB)],
             timeout=60, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "", f"importable in the runtime install: {r.stdout}"
    r = _run([py, "-c", "import kvgate, os; print(os.path.dirname(kvgate.__file__))"], timeout=60, cwd=tmp_path)
    assert r.returncode == 0 and str(env_dir) in r.stdout, r.stdout + r.stderr  # the installed copy

    server = start_redis()
    try:
        r = _run([py, "-c", TURN, server.url, ",".join(LAB)], timeout=120, cwd=tmp_path)
        assert r.returncode == 0, r.stdout + r.stderr
        lines = r.stdout.splitlines()
        assert lines[0] == "admit open"  # a real admission, through the Lua scripts the wheel ships
        assert lines[1] == "leases after 0" and lines[2] == "lab []"
        r = _run([kvgate_cmd, "status", "--redis", server.url, "--gate", "pkg"], timeout=60, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert "ledger" in r.stdout and "engines" in r.stdout and "e1" in r.stdout
        assert "━" not in r.stdout and "╭" not in r.stdout  # plain text: no rich
    finally:
        server.stop()
    r = _run([kvgate_cmd, "bench", "--no-progress"], timeout=60, cwd=tmp_path)
    assert r.returncode == 2
    assert "pip install 'kvgate[bench]'" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "bench-out").exists()  # refused before anything ran
