"""benchmarks/soak.py at a small size: many short sessions through one gate, clients killed
with SIGKILL while they hold leases, and Redis back to its idle key count and memory after,
with nothing left in any structure and no pub/sub channel or subscriber left over.

The soak decides what a leak is (its ``leaks`` list, docs/reliability.md#memory-soak); this
test runs the same code as the 100,000-session run, with the script's own bounds on every
wait, and checks what it reports. No timing is asserted.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import require_binaries

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "soak.py"
#: a hang detector for the whole run (some 15 s on an idle 2-core machine)
RUN_BOUND_S = 300

pytestmark = [pytest.mark.redis_real, pytest.mark.slow]


def test_small_soak_returns_redis_to_idle():
    require_binaries("redis-server")
    r = subprocess.run([sys.executable, str(SCRIPT), "--sessions", "2000", "--procs", "2", "--threads", "4",
                        "--kills", "3", "--json"], capture_output=True, text=True, timeout=RUN_BOUND_S)
    assert r.stdout, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["leaks"] == [] and r.returncode == 0, out["leaks"]
    assert Path(out["kvgate"]) == ROOT / "kvgate"
    assert out["kills"] == 3 and out["outcomes"]["sessions"] == 2000
    # the killed clients' leases came back by their TTL; nothing raised or degraded
    assert out["totals"]["lease_expired"] >= 3 * 2
    assert not [k for k in out["outcomes"] if k.startswith("raised/") or k == "bypass/degraded"]
    assert out["end"]["records"] == 0 and out["end"]["keys"] == out["idle"]["keys"]
    assert out["end"]["subscribers"] == 0 and out["peak_records"] <= out["record_bound"]
    assert out["samples"], "no sample was taken during the run"
