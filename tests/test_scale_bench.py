"""benchmarks/scale.py runs end to end (``--quick``, and ``--cluster --quick``) and reports
what it says it reports.

It starts its own redis-server, or its own 3-node Redis Cluster (``cluster``), and crowd
processes (``redis_real``, ``slow``). Only the
output's shape and its counts are checked: a count of script calls is a property of the code,
a latency or a rate is not.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import require_binaries

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "scale.py"
#: a hang detector for the whole quick run (some 10 s on an idle 2-core machine)
RUN_BOUND_S = 300

LEVEL_KEYS = {"procs", "admissions", "admissions_per_s", "wake_p50_ms", "wake_p99_ms", "server_us_per_call",
              "script_calls_per_admission", "commands_per_admission", "server_us_per_admission", "recheck_us",
              "not_admitted", "script_us_per_call"}


@pytest.mark.redis_real
@pytest.mark.slow
def test_quick_run_reports_every_level_across_processes():
    require_binaries("redis-server")
    r = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json"], capture_output=True, text=True,
                       timeout=RUN_BOUND_S)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert Path(out["kvgate"]) == ROOT / "kvgate"
    assert set(out["levels"]) == {"10", "100"}
    for m in out["levels"].values():
        assert set(m) == LEVEL_KEYS and m["procs"] == 4
        assert m["admissions"] > 0 and m["not_admitted"] == 0
        assert m["wake_p50_ms"] <= m["wake_p99_ms"]
        # a hand-off is the admitted waiter's release and the next head's claim of its grant
        # (and the admission's own re-check): a whole number of script calls, each running commands
        assert abs(m["script_calls_per_admission"] - round(m["script_calls_per_admission"])) < 0.05
        assert m["commands_per_admission"] > m["script_calls_per_admission"] >= 2
        assert set(m["script_us_per_call"]) <= {"acquire", "release"}


@pytest.mark.redis_real
@pytest.mark.cluster
@pytest.mark.slow
def test_quick_cluster_run_reports_every_gate_node_and_level():
    require_binaries("redis-server", "redis-cli")
    r = subprocess.run([sys.executable, str(SCRIPT), "--cluster", "--quick", "--json"], capture_output=True,
                       text=True, timeout=RUN_BOUND_S)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["gates"] == 3 and len(out["nodes"]) == 3
    assert set(out["levels"]) == {"10", "100"}
    for lv in out["levels"].values():
        assert set(lv) == {"total", "gates", "nodes"} and len(lv["gates"]) == 3
        # three gates on three nodes: each its own hash tag, one gate per node
        assert sorted(m["node"] for m in lv["gates"].values()) == out["nodes"] == sorted(lv["nodes"])
        assert all(len(n["gates"]) == 1 for n in lv["nodes"].values())
        for m in [*lv["gates"].values(), lv["total"]]:
            assert set(m) - {"node"} == LEVEL_KEYS
            assert m["admissions"] > 0 and m["not_admitted"] == 0
            assert m["wake_p50_ms"] <= m["wake_p99_ms"]
            assert abs(m["script_calls_per_admission"] - round(m["script_calls_per_admission"])) < 0.05
            assert m["commands_per_admission"] > m["script_calls_per_admission"] >= 2
        # the processes are --quick's 4, split over the gates; the total is every gate's
        assert sum(m["procs"] for m in lv["gates"].values()) == lv["total"]["procs"] == 4
        assert sum(m["admissions"] for m in lv["gates"].values()) == lv["total"]["admissions"]
