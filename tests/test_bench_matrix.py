"""``kvgate bench --matrix``: the table and the JSON from synthetic results, its flags, and one
tiny matrix end to end on the simulator (two scenarios, two rounds). No timings are asserted."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvgate.tools.bench import cli as bench_cli
from kvgate.tools.bench.engines import Counters
from kvgate.tools.bench.flags import build_parser
from kvgate.tools.bench.matrix import matrix_document, matrix_row, render_matrix
from kvgate.tools.bench.outcome import evaluate
from kvgate.tools.bench.policies import Policy, parse_policies
from kvgate.tools.bench.preflight import Plan
from kvgate.tools.bench.runner import PolicyResult, TurnRecord
from kvgate.tools.bench.scenarios import SCENARIOS
from kvgate.tools.bench.sweep import CapSweep
from kvgate.tools.bench.workload import IntRange, WorkloadSpec, generate

ROOT = Path(__file__).resolve().parents[1]


def _workload():
    # one session of two turns: 100 + 10 fresh tokens, 215 prompt tokens in all
    return generate(WorkloadSpec(sessions=1, turns=IntRange(2, 2), first_prompt=IntRange(100, 100),
                                 tool_result=IntRange(10, 10), output=IntRange(5, 5)), seed=0)


def _result(policy: Policy, wall: float, hits: int) -> PolicyResult:
    """``hits`` of the 215 prompt tokens came from the cache (the engine's counters); with the
    block size unknown, re-prefill is the uncached tokens beyond the 110 fresh ones."""
    turns = [TurnRecord(session="s", turn=i, ready_s=2 * i, start_s=2 * i, done_s=2 * i + 1, prompt_tokens=p,
                        cached_tokens=None, output_tokens=5) for i, p in enumerate((100, 115))]
    return PolicyResult(policy=policy, wall_s=wall, turns=turns, counters=Counters(hits, 215),
                        samples=[], usage_samples=[])


def _outcome(name: str, walls: list[dict], caps: list[int], widen: bool = True):
    """An evaluated outcome of scenario ``name``: one round per dict of policy -> wall-clock."""
    wl = _workload()
    sweep = CapSweep(caps, len(wl.sessions), widen=widen)
    policies = parse_policies("none,cap,kvgate", sweep.caps)
    plan = Plan(name=name, scenario=SCENARIOS[name], time_scale=SCENARIOS[name].time_scale, snapshot_interval_s=0.1,
                workload=wl, env=None, pool=None, policies=policies, sweep=sweep, base_cfg=None)
    hits = {"none": 10, "kvgate": 190}
    rounds = [[_result(p, w[p.name], hits.get(p.name, 60)) for p in policies] for w in walls]
    return evaluate(plan, rounds, build_parser().parse_args(["--matrix"]))


def test_a_matrix_row_compares_kvgate_with_the_better_of_no_gate_and_the_best_cap(capsys):
    from rich.console import Console

    # default: the best cap (cap-3, by median) beats no gate; kvgate's ratio is the median of
    # its per-round ratios to cap-3: 0.9, 1.1, 0.95 -> 0.95 (not the ratio of the medians)
    d = _outcome("default", [{"none": 20.0, "cap-2": 12.0, "cap-3": 10.0, "kvgate": 9.0},
                             {"none": 21.0, "cap-2": 13.0, "cap-3": 10.0, "kvgate": 11.0},
                             {"none": 19.0, "cap-2": 11.0, "cap-3": 12.0, "kvgate": 11.4}], [2, 3])
    # no-pressure: no cap below the sessions, so no gate is the better; kvgate 1.02x of it
    n = _outcome("no-pressure", [{"none": 10.0, "kvgate": 10.2}], [])
    rows = [matrix_row(d), matrix_row(n)]
    assert rows[0] == {"scenario": "default", "kvgate_wall_s": 11.0, "none_wall_s": 20.0, "best_cap": 3,
                       "best_cap_wall_s": 10.0, "better": "cap-3", "kvgate_vs_better": pytest.approx(0.95),
                       "within_target": True, "hit_rate": {"kvgate": pytest.approx(190 / 215),
                                                           "none": pytest.approx(10 / 215),
                                                           "best_cap": pytest.approx(60 / 215)},
                       "reprefill_tokens": {"kvgate": 0, "none": 95, "best_cap": 45}, "caps": [2, 3],
                       "modified": False}
    assert rows[1]["better"] == "none" and rows[1]["best_cap"] is None
    assert rows[1]["kvgate_vs_better"] == pytest.approx(1.02) and rows[1]["within_target"] is True
    # the scenario-specific targets are in the outcome's checks, not in the row
    checks = {name: ok for name, ok, _ in d.verdicts}
    assert checks["kvgate wall-clock <= 0.6x no gate"] is True and checks["kvgate beats the best fixed cap (cap-3)"]
    assert {name: ok for name, ok, _ in n.verdicts} == {
        "kvgate within 5% of the better of no gate and the best fixed cap (none)": True,
        "kvgate costs <= 3% vs no gate": True}
    render_matrix(rows, Console(width=250), rounds=3)
    out = capsys.readouterr().out
    lines = {ln.split("│")[1].strip(): [c.strip() for c in ln.split("│")[1:-1]]
             for ln in out.splitlines() if ln.startswith("│")}
    assert lines["default"][:7] == ["default", "11.00", "20.00", "cap-3", "10.00", "0.950x cap-3", "PASS"]
    assert lines["default"][7:13] == ["0.884", "0.047", "0.279", "0", "95", "45"]
    assert lines["no-pressure"][3] == "-" and lines["no-pressure"][5] == "1.020x none"
    assert "medians of 3 rounds" in out
    doc = matrix_document([d, n], rows, {"rounds": 3, "host": {"cpu": "x"}})
    assert doc["mode"] == "matrix" and doc["table"] == rows and doc["host"] == {"cpu": "x"}
    by = {s["scenario"]: s for s in doc["scenarios"]}
    assert [p["policy"] for p in by["default"]["policies"]] == ["none", "cap-2", "cap-3", "kvgate"]
    assert by["default"]["cap_sweep"]["caps"] == [2, 3] and by["default"]["best_cap"] == "cap-3"
    assert [c["passed"] for c in by["default"]["checks"]] == [True, True, True]
    assert json.loads(json.dumps(doc, default=str))["table"][1]["better"] == "none"


def test_a_failing_scenario_fails_its_row():
    slow = _outcome("cpu-tiny", [{"none": 10.0, "cap-2": 12.0, "kvgate": 10.6}], [2])
    row = matrix_row(slow)
    assert row["better"] == "none" and row["kvgate_vs_better"] == pytest.approx(1.06)
    assert row["within_target"] is False


@pytest.mark.parametrize("argv, needle", [
    (["--matrix", "--policies", "none,kvgate"], "--policies cannot be used with --matrix"),
    (["--matrix", "--scenario", "default"], "--scenario cannot be used with --matrix"),
    (["--matrix", "--caps", "2,3"], "--caps cannot be used with --matrix"),
    (["--matrix", "--engine", "http://127.0.0.1:1"], "--engine cannot be used with --matrix"),
    (["--matrix", "--scenarios", "default,bogus"], "unknown scenario(s) bogus"),
    (["--matrix", "--scenarios", "default,default"], "default given twice"),
    (["--scenarios", "default"], "--scenarios applies to --matrix"),
])
def test_matrix_flags_are_checked_before_anything_runs(tmp_path, argv, needle, capsys):
    assert bench_cli.main([*argv, "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    assert needle in capsys.readouterr().out
    assert not (tmp_path / "o").exists()


def test_check_args_plans_every_scenario_of_the_matrix():
    assert bench_cli.check_args(["--matrix"]) is None
    assert bench_cli.check_args(["--matrix", "--scenarios", "cpu-tiny,no-pressure", "--rounds", "3"]) is None


TINY = ["--sessions", "4", "--turns", "2", "--first-prompt", "900", "--tool-result", "10", "--output", "4",
        "--time-scale", "0.01"]


@pytest.mark.redis_real
@pytest.mark.timeout(300)
def test_a_tiny_matrix_runs_two_scenarios_in_two_rounds_end_to_end(tmp_path, redis_url):
    # through `kvgate bench`, as a user runs it (the kvgate command sets the log level to INFO):
    # the poller's INFO lines go to bench.log in --out, not to the console
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "kvgate.cli", "bench", "--matrix", "--scenarios", "cpu-tiny,no-pressure",
                        *TINY, "--rounds", "2", "--redis", redis_url, "--out", str(out), "--no-progress"],
                       capture_output=True, text=True, timeout=280, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "kvgate.control.poller" not in r.stdout + r.stderr
    assert "kvgate.control.poller" in (out / "bench.log").read_text()
    doc = json.loads((out / "bench.json").read_text())
    assert doc["mode"] == "matrix" and doc["rounds"] == 2
    assert [row["scenario"] for row in doc["table"]] == ["cpu-tiny", "no-pressure"]
    assert not (out / "latency_by_turn.png").exists()  # the matrix draws no plots
    for sc in doc["scenarios"]:
        names = [p["policy"] for p in sc["policies"]]
        caps = [p["cap"] for p in sc["policies"] if p["kind"] == "cap"]
        assert names == ["none"] + [f"cap-{c}" for c in caps] + ["kvgate"]
        assert caps == sc["cap_sweep"]["caps"] and all(1 <= c < 4 for c in caps)
        for p in sc["policies"]:  # every policy, added caps too, ran in both rounds
            assert len(p["rounds"]) == 2 and p["errors"] == 0 and p["turns_done"] == 8
        assert sc["scenario_modified_by"]  # the workload flags changed both scenarios
        assert sc["checks"][0]["check"].startswith("kvgate within 5% of the better of no gate")
    tiny, free = doc["scenarios"]
    assert tiny["cap_sweep"]["initial"] == [2, 3]  # 900-token sessions on a 2,528-token pool: fit 2
    assert free["cap_sweep"]["caps"] == [] and free["checks"][0]["made"]  # everything fits: vs no gate
    text = " ".join(r.stdout.split())
    assert "kvgate bench --matrix: medians of 2 rounds" in text
    assert "cpu-tiny: " in text and "no-pressure: " in text  # each scenario's verdicts, named
