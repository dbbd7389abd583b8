"""A short end-to-end bench run: every policy against the SGLang simulator, real Redis.

Tiny sizes and a fast time scale; checks structure and accounting, never timings.
"""
from __future__ import annotations

import json

import pytest

from kvgate.tools.bench import cli as bench_cli
from kvgate.tools.bench.engines import parse_counters, SGLANG_COUNTERS, VLLM_COUNTERS
from kvgate.tools.bench import preflight, scenarios
from kvgate.tools.bench.flags import build_parser
from kvgate.tools.bench.policies import parse_policies
from kvgate.tools.bench.scenarios import SCENARIOS

pytestmark = pytest.mark.timeout(120)

POLICIES = "none,cap,turncap-2,admission,residency,kvgate"


def _run(tmp_path, *extra):
    out = tmp_path / "out"
    args = ["--sessions", "6", "--turns", "3-4", "--first-prompt", "200-300", "--tool-result", "20-40",
            "--output", "8-16", "--time-scale", "0.01", "--kv-capacity", "2048", "--caps", "2,4",
            "--policies", POLICIES, "--out", str(out), "--no-progress", *extra]
    rc = bench_cli.main(args)
    return rc, json.loads((out / "bench.json").read_text()), out


@pytest.mark.redis_real
def test_every_policy_end_to_end(tmp_path, redis_url):
    rc, data, out = _run(tmp_path, "--redis", redis_url)
    assert rc == 0
    names = [p["policy"] for p in data["policies"]]
    assert names == ["none", "cap-2", "cap-4", "turncap-2", "admission", "residency", "kvgate"]
    n_turns = data["workload"]["turns"]
    for p in data["policies"]:
        assert p["errors"] == 0, p["error_examples"]
        assert p["turns_done"] == n_turns
        assert p["wall_s"] > 0
        assert p["hit_rate_source"] == "engine /metrics"
        assert 0.0 <= p["hit_rate"] <= 1.0
        # every prompt token was either a cache hit or prefilled
        assert p["uncached_tokens"] <= p["prompt_tokens"]
        assert p["latency_p50_s"] <= p["latency_p99_s"]
        assert set(p["latency_by_turn_s"]) == {str(i) for i in range(4)}
        # one row per session, in the order they finished; time splits into wait/engine/rest
        rows = p["sessions"]
        assert len(rows) == data["workload"]["sessions"]
        assert [r["end_s"] for r in rows] == sorted(r["end_s"] for r in rows)
        assert rows[-1]["end_s"] <= p["wall_s"] + 0.01
        for r in rows:
            assert r["turns_done"] == r["turns"] and 3 <= r["turns"] <= 4
            assert r["first_ready_s"] <= r["first_start_s"] < r["end_s"]
            assert r["waited_s"] >= 0 and r["engine_s"] > 0 and r["other_s"] >= -0.01
            if p["kind"] == "gate":  # how each of its turns got in
                assert sum(r["admissions"].values()) == r["turns"]
        if p["policy"] == "none":
            # nothing holds a turn back: no gate was built or called for it, so no turn has an
            # admission record, a gate config, gate samples or step metrics
            assert all(r["admissions"] == {} for r in rows)
            assert (p["gate"], p["gate_over_time"], p["step_metrics"]) == ({}, [], {})
            assert p["waits"] == 0 and p["gate_preemptions"] == 0
        lag = p["loop_lag_s"]  # the bench's own event loop was watched for the whole step
        assert lag["n"] > 0 and 0 <= lag["p50"] <= lag["p99"] <= lag["max"]
        if p["kind"] == "gate":
            assert sum(p["admissions"].values()) == n_turns
            assert p["gate"]["snapshots"]
            assert p["step_metrics"], "gate.step_metrics() was empty"
        else:
            assert p["admissions"] == {}
    by = {p["policy"]: p for p in data["policies"]}
    assert by["residency"]["gate"]["probe"] == "HttpProbe"
    assert by["admission"]["gate"]["probe"] is None
    assert by["none"]["ratio_to_none"] == 1.0
    assert data["best_cap"] in ("cap-2", "cap-4")
    assert (out / "hit_rate_over_time.png").stat().st_size > 0
    assert (out / "latency_by_turn.png").stat().st_size > 0


def test_embedded_fakeredis_fallback(tmp_path):
    out = tmp_path / "out"
    rc = bench_cli.main(["--sessions", "3", "--turns", "2", "--first-prompt", "100", "--tool-result", "10",
                         "--output", "4", "--time-scale", "0.01", "--policies", "none,kvgate",
                         "--embedded-redis", "fakeredis", "--out", str(out), "--no-progress", "--no-plots"])
    assert rc == 0
    data = json.loads((out / "bench.json").read_text())
    assert data["redis"] == "fakeredis"
    assert all(p["turns_done"] == data["workload"]["turns"] for p in data["policies"])


@pytest.mark.redis_real
def test_rounds_run_every_policy_again_side_by_side(tmp_path, redis_url, capsys):
    out = tmp_path / "out"
    rc = bench_cli.main(["--sessions", "3", "--turns", "2", "--first-prompt", "100", "--tool-result", "10",
                         "--output", "4", "--time-scale", "0.01", "--policies", "none,cap-2,kvgate",
                         "--rounds", "2", "--redis", redis_url, "--out", str(out), "--no-progress", "--no-plots"])
    assert rc == 0
    data = json.loads((out / "bench.json").read_text())
    assert data["rounds"] == 2
    for p in data["policies"]:
        assert len(p["rounds"]) == 2 and all(r["wall_s"] > 0 for r in p["rounds"])
        assert p["wall_s"] == pytest.approx(sum(r["wall_s"] for r in p["rounds"]) / 2)  # the median of two
        assert p["turns_done"] == data["workload"]["turns"]
    assert "rounds, kvgate: x none" in capsys.readouterr().out


@pytest.mark.redis_real
def test_sim_prefill_metrics_give_the_gate_a_prefill_cost(tmp_path, redis_url):
    # the simulator's prefill time (on by default) reaches the gate through the real poller, as
    # vLLM's does
    out = tmp_path / "out"
    rc = bench_cli.main(["--sessions", "4", "--turns", "4", "--first-prompt", "400", "--tool-result", "40",
                         "--output", "8", "--time-scale", "0.1", "--policies", "kvgate",
                         "--redis", redis_url, "--out", str(out), "--no-progress", "--no-plots"])
    assert rc == 0
    data = json.loads((out / "bench.json").read_text())
    assert data["engines"]["prefill_metrics"] is True
    costs = [s["prefill_s_per_token"] for s in data["policies"][0]["gate_over_time"]]
    assert any(c is not None and c > 0 for c in costs)


@pytest.mark.redis_real
def test_steps_run_back_to_back_on_one_gate_with_new_sessions(tmp_path, redis_url):
    rc, data, out = _run(tmp_path, "--redis", redis_url, "--steps", "2", "--policies", "none,kvgate")
    assert rc == 0
    assert "--steps 2" in data["scenario_modified_by"]
    n_turns = data["workload"]["turns"]
    for p in data["policies"]:
        assert p["errors"] == 0, p["error_examples"]
        walls = p["step_walls"]
        assert len(walls) == 2 and all(w > 0 for w in walls)
        assert p["wall_s"] == walls[-1]  # every figure is the last step's
        assert p["turns_done"] == n_turns
        assert {r["session"][-2:] for r in p["sessions"]} == {"~1"}  # the last step's sessions are new
    # one gate and one poller through both steps: the budget's state carries over
    log = (out / "bench.log").read_text()
    assert log.count("writes snapshots with the gate knobs") == 1, log


@pytest.mark.parametrize("argv", [["--policies", "none,bogus"], ["--caps", "0"], ["--turns", "5-2"],
                                  ["--time-scale", "0"], ["--profile", "no-such-profile"],
                                  ["--engine", "ftp://x"], ["--knob", "headroom=7", "--policies", "kvgate"],
                                  ["--rounds", "0"], ["--steps", "0"], ["--engine", "http://127.0.0.1:9", "--sim-prefill-metrics"],
                                  ["--engine", "http://127.0.0.1:9", "--no-sim-prefill-metrics"]])
def test_bad_arguments_exit_2_before_running(tmp_path, argv):
    assert bench_cli.main([*argv, "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    assert not (tmp_path / "o").exists()


def test_bad_rounds_are_reported_before_any_engine_is_asked(tmp_path, capsys):
    import http.server
    import threading

    hits = []

    class Engine(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            hits.append(self.path)
            self.send_response(404)
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Engine)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        rc = bench_cli.main(["--engine", f"http://127.0.0.1:{srv.server_address[1]}", "--rounds", "0",
                             "--out", str(tmp_path / "o"), "--no-progress"])
    finally:
        srv.shutdown()
    assert rc == 2 and "--rounds must be an integer >= 1" in capsys.readouterr().out
    assert hits == []


def test_check_args_finds_the_errors_of_a_run_without_touching_an_engine():
    # port 1 answers nothing: a probe of the pool would fail, so None means nothing was asked
    eng = ["--engine", "http://127.0.0.1:1", "--engine-kind", "vllm", "--scenario", "cpu-heavy", "--vocab", "1000"]
    assert bench_cli.check_args([*eng, "--caps", "2,3,4"]) is None
    assert bench_cli.check_args([*eng]) is None  # default caps need the pool: a placeholder here
    assert "unknown knob 'max_wait'" in bench_cli.check_args([*eng, "--policies", "kvgate[max_wait=3]"])
    assert "--caps" in bench_cli.check_args([*eng, "--caps", "0"])
    assert "headroom" in bench_cli.check_args([*eng, "--headroom", "7", "--policies", "kvgate"])
    with pytest.raises(SystemExit) as e:
        bench_cli.check_args([*eng, "heavy"])  # a stray word: argparse's own error
    assert e.value.code == 2


def test_real_vllm_wrapper_rejects_bad_bench_arguments_before_starting_a_server(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    # --venv-python /bin/false: a server start could not succeed even if the check let it through
    for extra, needle in ((["--policies", "none,kvgate[max_wait=3]"], "unknown knob 'max_wait'"),
                          (["heavy"], "unrecognized arguments: heavy")):  # `real_vllm.sh tiny heavy`
        r = subprocess.run([sys.executable, str(root / "benchmarks" / "real_vllm.py"), "--model", "tiny",
                            "--venv-python", "/bin/false", "--out", str(tmp_path / "o"), "--", *extra],
                           capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert r.returncode == 2, r.stderr
        assert needle in r.stderr
        assert not (tmp_path / "o").exists()
    r = subprocess.run(["bash", str(root / "benchmarks" / "real_vllm.sh"), "bogus"],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 2 and "unknown model 'bogus'" in r.stderr


def test_parse_policies():
    ps = parse_policies("none,cap,kvgate,turncap-3", [2, 8])
    assert [p.name for p in ps] == ["none", "cap-2", "cap-8", "kvgate", "turncap-3"]
    assert ps[3].admission and ps[3].residency
    with pytest.raises(ValueError):
        parse_policies("none,none", [])
    with pytest.raises(ValueError):
        parse_policies("cap", [])


def test_counters_aggregate_ranks_by_max_and_sources_by_sum():
    text = "\n".join([
        "# TYPE sglang:prompt_tokens_total counter",
        'sglang:prompt_tokens_total{tp_rank="0"} 1000',
        'sglang:prompt_tokens_total{tp_rank="1"} 1000',
        "# TYPE sglang:cached_tokens_total counter",
        'sglang:cached_tokens_total{cache_source="device",tp_rank="0"} 600',
        'sglang:cached_tokens_total{cache_source="device",tp_rank="1"} 600',
        'sglang:cached_tokens_total{cache_source="host",tp_rank="0"} 100',
    ])
    c = parse_counters(text, SGLANG_COUNTERS)
    assert (c.queries, c.hits) == (1000, 700)
    v = parse_counters("vllm:prefix_cache_queries_total{engine=\"0\"} 50\n"
                       "vllm:prefix_cache_hits_total{engine=\"0\"} 20\n", VLLM_COUNTERS)
    assert v.hit_rate == pytest.approx(0.4)


def test_policy_knobs_parse_and_apply():
    from kvgate import GateConfig
    from kvgate.tools.bench.policies import scaled_gate_config

    ps = parse_policies("none,kvgate,kvgate[max_wait_s=600,headroom=0.8],admission[scope=all]", [])
    assert [p.name for p in ps] == ["none", "kvgate", "kvgate[max_wait_s=600,headroom=0.8]", "admission[scope=all]"]
    assert ps[2].knobs == (("max_wait_s", 600), ("headroom", 0.8))
    cfg = scaled_gate_config(GateConfig(), ps[2], 0.5)
    assert (cfg.admission, cfg.residency, cfg.headroom, cfg.max_wait_s) == (True, True, 0.8, 300.0)
    assert scaled_gate_config(GateConfig(), ps[3], 1.0).scope == "all"


@pytest.mark.parametrize("text, needle", [
    ("kvgate[max_wait_s=600", "unbalanced"),
    ("kvgate]", "unbalanced"),
    ("cap-3[max_wait_s=1]", "follow a gate policy"),
    ("kvgate[bogus=1]", "unknown knob 'bogus'"),
    ("kvgate[admission=false]", "unknown knob 'admission'"),
    ("kvgate[max_wait_s]", "NAME=VALUE"),
    ("kvgate[x=1]tail", "close the name"),
    ("kvgate[max_wait_s=abc]", "max_wait_s='abc'"),
    ("kvgate[admission_x=1]", "unknown knob 'admission_x'"),
])
def test_bad_policy_knobs_are_clear_errors(text, needle):
    with pytest.raises(ValueError, match=needle.replace("[", r"\[")):
        parse_policies(text, [])


def test_bad_policy_knob_value_fails_before_the_run(tmp_path, capsys):
    from kvgate.tools.bench.cli import main

    rc = main(["--policies", "kvgate[headroom=2]", "--sessions", "2", "--turns", "2", "--no-progress",
               "--no-plots", "--out", str(tmp_path)])
    assert rc == 2
    assert "headroom" in capsys.readouterr().out
    assert not (tmp_path / "bench.json").exists()


@pytest.mark.redis_real
def test_a_policy_with_its_own_knobs_runs_beside_the_default(tmp_path, redis_url):
    rc, data, _ = _run(tmp_path, "--redis", redis_url, "--policies", "kvgate,kvgate[max_wait_s=0,idle_grace_s=0]",
                       "--no-plots")
    assert rc == 0
    by = {p["policy"]: p for p in data["policies"]}
    assert set(by) == {"kvgate", "kvgate[max_wait_s=0,idle_grace_s=0]"}
    for p in by.values():
        assert p["errors"] == 0 and p["turns_done"] == data["workload"]["turns"]
    knobbed = by["kvgate[max_wait_s=0,idle_grace_s=0]"]["gate"]["config"]
    assert knobbed["max_wait_s"] == 0 and knobbed["idle_grace_s"] == 0
    assert by["kvgate"]["gate"]["config"]["max_wait_s"] > 0


def test_default_cap_sweep_is_one_one_and_a_half_and_two_times_the_sessions_that_fit():
    from kvgate.tools.bench.scenarios import build_workload
    from kvgate.tools.bench.sweep import default_caps

    args = build_parser().parse_args([])
    wl = build_workload(args, SCENARIOS["default"])
    fit = int(131072 / (wl.working_set_tokens() / len(wl.sessions)))
    assert default_caps(wl, 131072) == [fit, (3 * fit + 1) // 2, 2 * fit] == [12, 18, 24]
    # a cap of every session is no gate: the sweep stops below the session count
    fit2 = int(2 * 131072 / (wl.working_set_tokens() / len(wl.sessions)))
    assert default_caps(wl, 2 * 131072) == [fit2, (3 * fit2 + 1) // 2] and 2 * fit2 >= len(wl.sessions)
    assert default_caps(wl, 10**9) == []  # everything fits: no cap is below the sessions
    # no pool known: a quarter of the sessions stands in for fit
    assert default_caps(wl, None) == [10, 15, 20]


@pytest.mark.redis_real
def test_only_the_default_gate_is_judged_and_knob_policies_print_whole(tmp_path, redis_url, capsys):
    # a knob policy's name is rich markup ("[...]"): the table must print it whole; the targets
    # are judged on `kvgate` with default knobs alone
    out = tmp_path / "out"
    rc = bench_cli.main(["--sessions", "3", "--turns", "2-3", "--first-prompt", "200-300", "--tool-result", "20-40",
                         "--output", "8-16", "--time-scale", "0.01", "--kv-capacity", "2048", "--no-plots",
                         "--policies", "none,cap-2,kvgate,kvgate[max_wait_s=600]", "--out", str(out),
                         "--no-progress", "--redis", redis_url])
    assert rc == 0
    text = capsys.readouterr().out
    assert "kvgate[max_wait_s=600]" in text
    assert "kvgate wall-clock <= 0.6x no gate" in text
    data = json.loads((out / "bench.json").read_text())
    assert {c["check"].split(" ")[0] for c in data["checks"]} == {"kvgate"}


@pytest.mark.redis_real
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_default_policies_are_every_kind_once(tmp_path, redis_url, scenario):
    # without --policies: every kind once, on every scenario and for a trace alike
    out = tmp_path / "out"
    base = ["none", "cap-2", "admission", "residency", "kvgate"]
    rc = bench_cli.main(["--scenario", scenario, "--sessions", "3", "--turns", "2", "--time-scale", "0.01",
                         "--caps", "2", "--redis", redis_url, "--out", str(out), "--no-progress", "--no-plots"])
    assert rc == 0
    data = json.loads((out / "bench.json").read_text())
    assert [p["policy"] for p in data["policies"]] == base
    assert data["cap_sweep"]["widen"] is False  # --caps given: the sweep is what it says
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"session": s, "turn": t, "input_tokens": 100 + 50 * t,
                                         "output_tokens": 10, "gap_s": 0.1}) + "\n"
                             for s in ("a", "b") for t in range(2)))
    rc = bench_cli.main(["--scenario", scenario, "--trace", str(trace), "--time-scale", "0.01", "--caps", "2",
                         "--redis", redis_url, "--out", str(out), "--no-progress", "--no-plots"])
    assert rc == 0
    assert [p["policy"] for p in json.loads((out / "bench.json").read_text())["policies"]] == base


@pytest.mark.redis_real
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_scenario_runs_its_turns_on_the_simulator(tmp_path, redis_url, scenario):
    # each named scenario, shrunk, on its own simulator profile: every turn must reach the
    # engine (the CPU profiles' 1,000-token vocabulary once turned every turn into a 400)
    out = tmp_path / "out"
    rc = bench_cli.main(["--scenario", scenario, "--sessions", "2", "--turns", "2", "--time-scale", "0.01",
                         "--policies", "none,kvgate", "--redis", redis_url, "--out", str(out),
                         "--no-progress", "--no-plots"])
    assert rc == 0
    data = json.loads((out / "bench.json").read_text())
    for p in data["policies"]:
        assert p["errors"] == 0, p["error_examples"]
        assert p["turns_done"] == 4


def test_workload_vocab_follows_the_scenario_and_the_profile():
    parse = build_parser().parse_args
    assert scenarios.workload_vocab(parse([]), SCENARIOS["default"]) == 32000  # GPU profile: 151,936, capped
    assert scenarios.workload_vocab(parse(["--scenario", "cpu-tiny"]), SCENARIOS["cpu-tiny"]) == 1000
    assert scenarios.workload_vocab(parse(["--profile", "cpu-vllm-heavy"]), SCENARIOS["default"]) == 1000
    assert scenarios.workload_vocab(parse(["--vocab", "500"]), SCENARIOS["cpu-tiny"]) == 500
    # real engines: the scenario's, else 32,000 (the engine's vocabulary is not exposed)
    assert scenarios.workload_vocab(parse(["--engine", "http://x"]), SCENARIOS["default"]) == 32000
    assert scenarios.workload_vocab(parse(["--engine", "http://x"]), SCENARIOS["cpu-heavy"]) == 1000
    with pytest.raises(ValueError, match="--vocab"):
        scenarios.workload_vocab(parse(["--vocab", "1"]), SCENARIOS["default"])


@pytest.mark.redis_real
def test_failed_turns_fail_the_checks_and_the_exit_code(tmp_path, redis_url, capsys, monkeypatch):
    # ids outside the simulator's 1,000-token vocabulary: every turn is refused with a 400.
    # The bench now refuses such a --vocab before running (test_bench_inputs); the pre-run
    # check is skipped here so that turns failing at run time are still seen to fail the run.
    monkeypatch.setattr(preflight, "check_sim_fits", lambda *a, **k: None)
    out = tmp_path / "out"
    rc = bench_cli.main(["--scenario", "cpu-tiny", "--sessions", "2", "--turns", "2", "--vocab", "5000",
                         "--policies", "none,kvgate", "--redis", redis_url, "--out", str(out),
                         "--no-progress", "--no-plots"])
    assert rc == 1
    text = capsys.readouterr().out
    assert "PASS" not in text
    assert "FAIL kvgate (no comparison): turns failed in kvgate (4), none (4)" in text
    assert "input_ids must hold integers in [0," in text  # the engine's reason, from the body
    data = json.loads((out / "bench.json").read_text())
    assert [c["passed"] for c in data["checks"]] == [False]
    assert all("body:" in e for p in data["policies"] for e in p["error_examples"])


def test_turns_spread_over_client_shards_one_per_session():
    import asyncio

    from kvgate.tools.bench.engines import make_client

    async def go():
        c = make_client("sglang", ["http://127.0.0.1:1"], ["http://127.0.0.1:1"], max_connections=64)
        a = c.http_for("s-1")
        assert c.http_for("s-1") is a  # a session keeps its shard (and its keep-alive connection)
        used = {id(c.http_for(f"s-{i}")) for i in range(200)}
        assert len(used) == c.SHARDS  # and sessions spread over all of them
        assert a._transport._pool._max_connections == 64  # per shard: no cap the workload did not ask for
        await c.aclose()
        assert a.is_closed
        assert c.http_for("s-1") is not a  # a closed client is not handed out again

    asyncio.run(go())


def test_turns_to_plain_http_engines_go_through_the_lean_pool():
    import asyncio

    from kvgate.tools.bench.engines import EngineHTTPError, make_client
    from kvgate.tools.sim import SimCluster

    urls = ["http://127.0.0.1:1", "https://127.0.0.1:2", "http://127.0.0.1:3/prefix"]
    c = make_client("sglang", urls, urls[:1], lean=True)
    # only a plain-http base without a path is safe for the lean HTTP/1.1 pool (no TLS, no base path)
    assert set(c._lean) == {"http://127.0.0.1:1"}
    asyncio.run(c.aclose())
    assert not make_client("vllm", urls, urls[:1])._lean  # real engines (--engine) keep httpx

    async def go(url: str):
        c = make_client("sglang", [url], [url], lean=True)
        try:
            assert url in c._lean
            a = await c.generate("s", list(range(3, 203)), 4)
            assert c._lean[url].idle  # the turn went through the pool: its connection is kept alive there
            b = await c.generate("s", list(range(3, 203)) + a.output_ids + [7, 8], 4)
            with pytest.raises(EngineHTTPError, match=r"HTTP 400 -- body: .*input_ids"):
                await c.generate("s", [10**9], 4)  # outside the vocabulary: the engine's reason
        finally:
            await c.aclose()
        return a, b

    with SimCluster(1, "gpu-h100-30b", time_scale=0.0, router=False) as sim:
        a, b = asyncio.run(go(sim.engine_urls[0]))
    assert len(a.output_ids) == 4 and a.prompt_tokens == 200 and a.cached_tokens == 0
    assert b.cached_tokens and b.cached_tokens >= 192  # the first turn's full blocks were reused


def _children(pid: int) -> list[int]:
    import os

    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    st = f.read()
            except OSError:
                continue
            if int(st.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d))
    return out


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


@pytest.mark.redis_real
@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self"), reason="needs /proc")
@pytest.mark.parametrize("delay", [0.0, 0.5])  # 0: while the simulator is still starting
def test_sigterm_stops_the_simulator_and_the_embedded_redis(tmp_path, delay):
    # a `kill` of the bench must not orphan its children: the simulator process and the
    # private redis-server are stopped by the same clean-up as Ctrl-C, and the exit is 130
    import signal
    import subprocess
    import sys
    import time

    from conftest import require_binaries

    require_binaries("redis-server")  # the embedded Redis must be a child process here, not fakeredis
    p = subprocess.Popen([sys.executable, "-m", "kvgate.tools.bench", "--policies", "none,kvgate", "--sessions", "6",
                          "--turns", "20", "--embedded-redis", "redis-server", "--out", str(tmp_path / "o"),
                          "--no-progress", "--no-plots"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        kids: list[int] = []
        sims: list[int] = []
        redises: list[int] = []
        while time.monotonic() < deadline:
            kids = _children(p.pid)
            sims, redises = [], []
            for k in kids:
                try:
                    with open(f"/proc/{k}/cmdline") as f:
                        cmd = f.read()
                except OSError:
                    continue
                if "kvgate.tools.sim" in cmd:
                    sims.append(k)
                if _comm(k) == "redis-server" or cmd.split("\0", 1)[0].endswith("redis-server"):
                    redises.append(k)
            if sims and redises:
                break
            time.sleep(0.1)
        # both children existed: the simulator, and the embedded redis-server (started first)
        assert sims and redises, [(k, _comm(k)) for k in kids]
        time.sleep(delay)
        p.send_signal(signal.SIGTERM)
        rc = p.wait(timeout=60)
        out = p.stdout.read().decode()
        assert rc == 130, out
        assert "interrupted" in out
        deadline = time.monotonic() + 10
        while any(_running(k) for k in kids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [k for k in kids if _running(k)]
        assert not any(_running(k) for k in sims + redises)  # the simulator and the redis-server too
        assert not (tmp_path / "o" / "bench.json").exists()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.skipif(not hasattr(__import__("signal"), "SIGTERM"), reason="needs SIGTERM")
def test_sigterm_inside_a_string_exec_still_exits_130(tmp_path):
    # CI once saw the bench exit -2 (killed by SIGINT) after printing "interrupted": CPython
    # remembers an exact KeyboardInterrupt that escapes any exec() of a string (dataclass and
    # namedtuple creation run one) and, under `python -m`, kills itself with SIGINT at exit
    # even when the exception was caught. Deliver the SIGTERM inside such an exec, on purpose.
    import subprocess
    import sys

    mod = tmp_path / "termmod"
    mod.mkdir()
    (mod / "__main__.py").write_text(
        "import sys\n"
        "from kvgate.tools.bench.signals import sigterm_interrupts\n"
        "try:\n"
        "    with sigterm_interrupts():\n"
        "        exec('import os, signal, time\\nos.kill(os.getpid(), signal.SIGTERM)\\ntime.sleep(10)')\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted', flush=True)\n"
        "    sys.exit(130)\n"
        "sys.exit(1)\n")
    import os

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path)] + sys.path))
    r = subprocess.run([sys.executable, "-m", "termmod"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=60)
    assert "interrupted" in r.stdout, r.stderr
    assert r.returncode == 130, (r.returncode, r.stderr)


def test_a_caps_wait_for_a_slot_counts_in_its_first_turns_latency(tmp_path):
    # under cap-1 the sessions run one after another: the later ones are ready at the start
    # and reach the engine only when a slot frees, so their first turns' latency holds that
    # wait (as a gate wait does), and the straggler line calls it a slot wait
    out = tmp_path / "out"
    rc = bench_cli.main(["--sessions", "3", "--turns", "2", "--first-prompt", "100", "--tool-result", "10",
                         "--output", "4", "--time-scale", "0.01", "--policies", "none,cap-1",
                         "--out", str(out), "--no-progress", "--no-plots"])
    assert rc == 0
    by = {p["policy"]: p for p in json.loads((out / "bench.json").read_text())["policies"]}
    rows = by["cap-1"]["sessions"]
    assert all(r["first_ready_s"] < rows[0]["end_s"] for r in rows)  # all ready at arrival
    for before, after in zip(rows, rows[1:]):
        assert after["first_start_s"] >= before["end_s"]  # one slot: strictly one at a time
        assert after["waited_s"] >= after["first_start_s"] - after["first_ready_s"] - 0.01
    # turn 0's mean latency holds the slot waits of the sessions that queued
    slot_waits = sum(r["first_start_s"] - r["first_ready_s"] for r in rows)
    assert slot_waits >= rows[0]["end_s"] + rows[1]["end_s"] - 0.05
    assert by["cap-1"]["latency_by_turn_s"]["0"] >= slot_waits / 3


def test_wall_clock_runs_from_the_first_arrival(tmp_path):
    # every session of this trace arrives 50 s (0.5 s scaled) into the step: that idle start
    # is not the policy's wall-clock
    trace = tmp_path / "late.jsonl"
    trace.write_text("".join(json.dumps({"session": s, "turn": t, "input_tokens": 100 + 50 * t,
                                         "output_tokens": 10, "gap_s": 50.0 if t == 0 else 0.1}) + "\n"
                             for s in ("a", "b") for t in range(2)))
    out = tmp_path / "out"
    rc = bench_cli.main(["--trace", str(trace), "--time-scale", "0.01", "--policies", "none",
                         "--out", str(out), "--no-progress", "--no-plots"])
    assert rc == 0
    (p,) = json.loads((out / "bench.json").read_text())["policies"]
    last_end = p["sessions"][-1]["end_s"]
    assert min(r["first_ready_s"] for r in p["sessions"]) >= 0.5
    assert p["wall_s"] == pytest.approx(last_end - 0.5, abs=0.05)


def test_embedded_redis_server_without_the_binary_is_a_bad_argument(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    rc = bench_cli.main(["--sessions", "2", "--turns", "2", "--policies", "none,kvgate",
                         "--embedded-redis", "redis-server", "--out", str(tmp_path / "o"), "--no-progress"])
    assert rc == 2
    assert "no redis-server binary on PATH" in capsys.readouterr().out
    assert not (tmp_path / "o").exists()


def test_a_redis_server_that_will_not_start_is_a_clear_error_with_its_log(tmp_path, monkeypatch, capsys):
    # a redis-server that writes one line to its --logfile and exits: the bench stops with the
    # log's words on the console (its temp dir is gone by then), exit 1, no traceback
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "redis-server"
    fake.write_text("#!/bin/sh\nwhile [ $# -gt 0 ]; do if [ \"$1\" = --logfile ]; then "
                    "echo 'FATAL CONFIG FILE ERROR (fake)' > \"$2\"; fi; shift; done\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:/usr/bin:/bin")
    rc = bench_cli.main(["--sessions", "2", "--turns", "2", "--policies", "none,kvgate",
                         "--embedded-redis", "redis-server", "--out", str(tmp_path / "o"), "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 1
    assert "redis-server did not start" in text and "FATAL CONFIG FILE ERROR (fake)" in text
    assert "Traceback" not in text
