"""benchmarks/overhead.py runs end to end (``--quick``) and reports what it says it reports.

It starts its own redis-server, so the test needs the binary (``redis_real``) and a child
process for the waiters' crowd (``slow``). Only the output's shape and its counts are checked:
a count of script calls or commands is a property of the code, a latency is not.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import require_binaries

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "overhead.py"
#: a hang detector for the whole quick run (it takes some 20 s on an idle 2-core machine)
RUN_BOUND_S = 300

BLOCK_KEYS = {"p50_ms", "p99_ms", "ops_per_s", "server_us", "script_calls", "inner_commands", "inner_us"}


def integer_ish(x: float) -> bool:
    return abs(x - round(x)) < 0.05


@pytest.mark.redis_real
@pytest.mark.slow
def test_quick_run_reports_every_figure_with_sane_counts(tmp_path):
    require_binaries("redis-server")
    r = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json"], capture_output=True, text=True,
                       timeout=RUN_BOUND_S, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    # the script measures the checkout it lives in, not another installed kvgate
    assert Path(out["kvgate"]) == ROOT / "kvgate"
    assert out["prompt_tokens"] == 5000 and out["rounds"] == 2

    sync = out["sync"]
    assert set(sync) == {"kvgate", "kvgate-eval", "lock", "ping"}
    for m in sync.values():
        assert set(m) == BLOCK_KEYS
        assert m["ops_per_s"] > 0 and m["p50_ms"] <= m["p99_ms"]
    # an uncontended turn is a whole number of script calls (acquire, release), each running
    # commands; a Lock is one script (its release) of two commands; a PING runs none
    # (the same turn in either form of the scripts: the function library, or EVAL)
    for form in ("kvgate", "kvgate-eval"):
        assert integer_ish(sync[form]["script_calls"]) and sync[form]["script_calls"] >= 2
        assert sync[form]["inner_commands"] > 0 and sync[form]["server_us"] > 0
    assert sync["lock"]["script_calls"] == 1 and sync["lock"]["inner_commands"] == 2
    assert sync["ping"]["script_calls"] == 0 and sync["ping"]["inner_commands"] == 0

    assert set(out["async"]) == {"kvgate", "lock", "ping"}
    for levels in out["async"].values():
        assert set(levels) == {"1", "16", "64", "256"}
        assert all(set(m) == BLOCK_KEYS for m in levels.values())
    assert all(integer_ish(m["script_calls"]) for m in out["async"]["kvgate"].values())

    b = out["breakdown"]
    assert b["turns"] == 30 and sum(b["reasons"].values()) == 30
    for name in ("acquire", "release"):
        assert b[name]["inner_commands"] > 0 and b[name]["by_command"]
    assert {"return_1", "helpers_only", "function_empty"} <= set(b)
    assert all(b[k]["server_us"] > 0 for k in ("return_1", "helpers_only", "function_empty"))
    # the floor's turn: the acquire's 8 commands and the release's 7 (FLOOR_LIBRARY), fewer
    # than the gate's own turn runs
    assert b["floor"]["server_us"] > 0 and integer_ish(b["floor"]["inner_commands"])
    assert round(b["floor"]["inner_commands"]) == 15
    assert b["floor"]["inner_commands"] < b["acquire"]["inner_commands"] + b["release"]["inner_commands"]
    assert set(b["units_us"]) == {"read command (HGET)", "write command (HSET)", "record decode", "record decode + encode",
                                  "parameters decode (ARGV[2])", "knobs decode (ARGV[3])", "TIME", "INFO server"}
    assert all(v >= 0 for v in b["units_us"].values())

    # a sync turn split on the client's side: its calls into redis-py, and kvgate's own Python
    c = out["client"]
    assert set(c) == {"turn_us", "in_redis_py_us", "kvgate_python_us", "bare_pair_us"}
    assert 0 < c["in_redis_py_us"] < c["turn_us"] and c["kvgate_python_us"] > 0 and c["bare_pair_us"] > 0

    assert set(out["waiters"]) == {"10", "100"}
    for w, m in out["waiters"].items():
        assert m["handoffs"] > 0 and not m["missed"], m
        # a hand-off: the release that grants, the head's claim, and the releaser queueing again
        assert integer_ish(m["script_calls"]) and m["inner_commands"] > 0
        assert {"acquire", "release"} <= set(m["script_us_per_call"])
        assert m["wake_p50_ms"] <= m["wake_p99_ms"] and m["recheck_us"] > 0
        # the same hand-offs made by one client alone: the same three calls
        q = m["quiet"]
        assert set(q) == {"server_us", "script_calls", "inner_commands"}
        assert q["script_calls"] == 3 and q["server_us"] > 0 and q["inner_commands"] > 0
    # no step walks the queue: a hand-off runs as many commands behind 100 waiters as behind 10
    # (up to the few the time integrals skip when two calls fall in one millisecond)
    quiet = [out["waiters"][w]["quiet"]["inner_commands"] for w in ("10", "100")]
    assert abs(quiet[0] - quiet[1]) < 3, quiet


def test_rejects_bad_arguments(tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPT), "--rounds", "0"], capture_output=True, text=True,
                       timeout=60, cwd=tmp_path)
    assert r.returncode == 2 and "--rounds must be >= 1" in r.stderr


PROFILE = ROOT / "benchmarks" / "lua_profile.py"


@pytest.mark.redis_real
def test_lua_profile_rows_name_the_statements_they_time(tmp_path):
    """benchmarks/lua_profile.py --quick: a row per statement of acquire.lua's and release.lua's
    bodies (and of grant and free_lease), each labelled with its file, line and text; a
    session re-entering its window runs each of them once a turn. Shapes and counts only."""
    require_binaries("redis-server")
    r = subprocess.run([sys.executable, str(PROFILE), "--quick", "--json"], capture_output=True, text=True,
                       timeout=RUN_BOUND_S, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["turns"] == 500 and out["checkpoint_us"] > 0 and out["into"] == ["grant", "free_lease"]
    rows = {row["statement"]: row for row in out["rows"]}
    # begin, the body and finish run once per script call: twice a turn
    assert {rows[k]["per_turn"] for k in ("(begin)", "(body)", "(finish)")} == {2.0}
    sources = {name: (ROOT / "lua" / path).read_text().split("\n") for name, path in
               (("acquire.lua", "acquire.lua"), ("release.lua", "release.lua"),
                ("grant()", "includes/leases.lua"), ("free_lease()", "includes/leases.lua"))}
    for label, row in rows.items():
        if label.startswith("("):
            continue
        name, _, rest = label.partition(":")
        line, _, text = rest.partition(" ")
        # the label's line of the real file starts with the statement the row times
        assert sources[name][int(line) - 1].strip().startswith(text), label
    for name in ("acquire.lua", "release.lua", "grant()", "free_lease()"):
        assert any(label.startswith(name + ":") for label in rows), name
    # every turn runs each script's accounting once, and grants and returns one lease
    assert [row["per_turn"] for label, row in rows.items() if label.endswith("account()")] == [1.0, 1.0]
    assert all(row["per_turn"] == 1.0 for label, row in rows.items()
               if label.startswith(("grant():", "free_lease():")) and "return" in label)


def test_lua_profile_rejects_a_turn_count_it_cannot_flush():
    r = subprocess.run([sys.executable, str(PROFILE), "--turns", "75"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "multiple of 50" in r.stderr
