"""`kvgate bench` refuses what it cannot run before anything runs: exit 2, one line, no traceback.

Redis URLs, engine URLs, the output directory, workload sizes against the engine, unbounded
waits and flags that would be ignored. No timings are asserted.
"""
from __future__ import annotations

import contextlib
import http.server
import json
import sys
import threading

import pytest

from kvgate.tools.bench import cli as bench_cli
from kvgate.tools.bench import runner
from kvgate.tools.bench.scenarios import SCENARIOS, build_workload
from kvgate.tools.bench.sweep import default_caps
from kvgate.tools.bench.trace import parse_trace

from conftest import free_port

pytestmark = pytest.mark.timeout(120)

SMALL = ["--sessions", "2", "--turns", "2", "--first-prompt", "100", "--tool-result", "10", "--output", "4",
         "--time-scale", "0.01", "--no-progress", "--no-plots"]


def _main(capsys, argv):
    rc = bench_cli.main(argv)
    out = capsys.readouterr().out
    return rc, out


@contextlib.contextmanager
def fake_engine(kind: str = "sglang", usage: bool = False, max_model_len: int | None = None):
    """A minimal HTTP engine: /health, /metrics, /generate (SGLang) or /v1/* (vLLM); no
    /kvgate/usage unless ``usage`` (a real SGLang has none). Yields (base URL, requests seen)."""
    seen: list[str] = []

    class H(http.server.BaseHTTPRequestHandler):
        def _send(self, code, body=b"", ctype="application/json"):
            self.send_response(code)
            self.send_header("content-type", ctype)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):  # noqa: N802 - http.server's name
            seen.append("GET " + self.path)
            if self.path == "/health":
                self._send(200)
            elif self.path == "/metrics":
                self._send(200, b"", "text/plain")
            elif self.path == "/kvgate/usage" and usage:
                self._send(200, json.dumps({"num_gpu_blocks": 80, "block_size": 32, "usage": 0.0}).encode())
            elif self.path == "/v1/models" and kind == "vllm":
                m = {"id": "fake"}
                if max_model_len is not None:
                    m["max_model_len"] = max_model_len
                self._send(200, json.dumps({"data": [m]}).encode())
            else:
                self._send(404)

        def do_POST(self):  # noqa: N802
            seen.append("POST " + self.path)
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            if self.path == "/generate" and kind == "sglang":
                d = json.loads(body)
                n = d["sampling_params"]["max_new_tokens"]
                self._send(200, json.dumps({"output_ids": [11] * n, "meta_info": {
                    "prompt_tokens": len(d["input_ids"]), "cached_tokens": 0}}).encode())
            elif self.path in ("/flush_cache", "/reset_prefix_cache"):
                self._send(200)
            else:
                self._send(404)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", seen
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(timeout=5)


# ---- 1. --redis -------------------------------------------------------------------------

def test_a_redis_url_without_a_scheme_is_refused_before_any_policy_runs(tmp_path, capsys):
    url = f"localhost:{free_port()}"
    assert "--redis" in bench_cli.check_args(["--redis", url])  # a syntax error: found offline too
    rc, out = _main(capsys, [*SMALL, "--policies", "none,kvgate", "--redis", url, "--out", str(tmp_path / "o")])
    assert rc == 2
    assert "--redis" in out and "redis://" in out and "Traceback" not in out
    assert not (tmp_path / "o").exists()


def test_a_redis_that_does_not_answer_is_refused_before_any_policy_runs(tmp_path, capsys):
    url = f"redis://127.0.0.1:{free_port()}/0"
    rc, out = _main(capsys, [*SMALL, "--policies", "none,kvgate", "--redis", url, "--out", str(tmp_path / "o")])
    assert rc == 2
    assert "--redis" in out and "PING" in out and "Traceback" not in out
    assert not (tmp_path / "o" / "bench.json").exists()


def test_a_redis_password_is_not_printed(tmp_path, capsys):
    url = f"redis://:s3cret-pw@127.0.0.1:{free_port()}/0"
    rc, out = _main(capsys, [*SMALL, "--policies", "kvgate", "--redis", url, "--out", str(tmp_path / "o")])
    assert rc == 2 and "s3cret-pw" not in out


def test_a_redis_url_is_not_pinged_when_no_gate_policy_runs(tmp_path, capsys):
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing there, and nothing needs it
    rc, _ = _main(capsys, [*SMALL, "--policies", "none", "--redis", url, "--out", str(tmp_path / "o")])
    assert rc == 0


# ---- 2. --engine ------------------------------------------------------------------------

def test_an_engine_that_does_not_answer_is_refused_before_running(tmp_path, capsys):
    url = f"http://127.0.0.1:{free_port()}"
    rc, out = _main(capsys, [*SMALL, "--policies", "none", "--engine", url, "--engine-kind", "sglang",
                             "--out", str(tmp_path / "o")])
    assert rc == 2
    assert url in out and "/health" in out and "Traceback" not in out
    assert not (tmp_path / "o" / "bench.json").exists()


def test_a_wrong_engine_url_is_refused_before_running(tmp_path, capsys):
    with fake_engine() as (url, seen):
        rc, out = _main(capsys, [*SMALL, "--policies", "none", "--engine", url + "/nope", "--engine-kind",
                                 "sglang", "--out", str(tmp_path / "o")])
    assert rc == 2 and "HTTP 404" in out
    assert not any(s.startswith("POST") for s in seen)  # no turn was sent


def test_an_engine_without_kvgate_usage_runs_and_the_header_names_the_workload(tmp_path, capsys):
    # a real SGLang has no /kvgate/usage: the pool is unknown, the run goes on, and the
    # header still says what runs (a conditional once swallowed the whole line)
    with fake_engine() as (url, seen):
        rc, out = _main(capsys, [*SMALL, "--policies", "none", "--engine", url, "--engine-kind", "sglang",
                                 "--out", str(tmp_path / "o")])
    assert rc == 0, out
    assert "scenario default: 2 sessions, 4 turns, working set" in out
    assert "pool unknown" in out
    assert any(s == "POST /generate" for s in seen)


@pytest.mark.parametrize("url,needle", [("http://127.0.0.1:99999", "Port out of range"), ("http://", "no host"),
                                        ("http://h:abc", "Port could not be cast")])
def test_malformed_engine_urls_are_refused_without_asking_anything(url, needle):
    err = bench_cli.check_args(["--engine", url])
    assert err and url in err and needle in err


def test_a_vllm_model_that_is_not_served_is_refused(tmp_path, capsys):
    with fake_engine("vllm") as (url, seen):
        rc, out = _main(capsys, [*SMALL, "--policies", "none", "--engine", url, "--model", "other",
                                 "--out", str(tmp_path / "o")])
    assert rc == 2 and "--model other: not served" in out and "fake" in out


def test_a_vllm_max_model_len_bounds_the_workload(tmp_path, capsys):
    with fake_engine("vllm", max_model_len=512) as (url, seen):
        rc, out = _main(capsys, [*SMALL, "--policies", "none", "--engine", url, "--first-prompt", "600",
                                 "--out", str(tmp_path / "o")])
    assert rc == 2
    assert "max_model_len" in out and "512" in out
    assert not any(s.startswith("POST /v1/completions") for s in seen)


def test_the_engines_smallest_pool_bounds_the_workload(tmp_path, capsys):
    with fake_engine("sglang", usage=True) as (url, seen):  # 80 blocks of 32: 2,560 tokens
        rc, out = _main(capsys, [*SMALL, "--policies", "none", "--engine", url, "--engine-kind", "sglang",
                                 "--first-prompt", "3000", "--out", str(tmp_path / "o")])
    assert rc == 2 and "2,560" in out
    assert not any(s == "POST /generate" for s in seen)


# ---- 3. --out ---------------------------------------------------------------------------

def test_an_out_path_that_is_a_file_is_refused_before_running(tmp_path, capsys):
    f = tmp_path / "afile"
    f.write_text("x")
    assert "--out" in bench_cli.check_args(["--out", str(f)])
    assert "--out" in bench_cli.check_args(["--out", str(f / "sub")])
    rc, out = _main(capsys, [*SMALL, "--policies", "none", "--out", str(f / "sub")])
    assert rc == 2 and "--out" in out and "Traceback" not in out


def test_an_out_file_name_taken_by_a_directory_is_refused(tmp_path):
    (tmp_path / "o" / "bench.json").mkdir(parents=True)
    assert "bench.json" in bench_cli.check_args(["--out", str(tmp_path / "o")])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")
def test_an_out_directory_that_cannot_be_created_is_refused_before_running(capsys):
    rc, out = _main(capsys, [*SMALL, "--policies", "none", "--out", "/proc/kvgate-bench-no/out"])
    assert rc == 2 and "--out" in out and "Traceback" not in out


def test_a_good_out_directory_is_created_before_the_run(tmp_path, capsys):
    rc, _ = _main(capsys, [*SMALL, "--policies", "none", "--out", str(tmp_path / "a" / "b")])
    assert rc == 0 and (tmp_path / "a" / "b" / "bench.json").is_file()


# ---- 4. workload sizes vs the engine ----------------------------------------------------

def test_contexts_past_the_profiles_context_length_are_refused():
    err = bench_cli.check_args(["--scenario", "cpu-tiny", "--turns", "30"])
    assert err and "2,048" in err and "context length" in err and "--turns" in err


def test_contexts_past_the_pool_less_one_block_are_refused():
    # the simulator refuses a request whose KV plus one block exceeds its pool
    err = bench_cli.check_args(["--kv-capacity", "1024", "--first-prompt", "1000", "--turns", "1",
                                "--output", "10"])
    assert err and "pool" in err


def test_a_vocab_above_the_profiles_is_refused():
    err = bench_cli.check_args(["--scenario", "cpu-tiny", "--vocab", "5000"])
    assert err and "5000" in err.replace(",", "") and "1000" in err.replace(",", "")
    assert bench_cli.check_args(["--scenario", "cpu-tiny", "--vocab", "1000"]) is None


def test_a_trace_line_past_the_context_length_is_refused_with_its_line(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(json.dumps({"session": "a", "turn": i, "input_tokens": n, "output_tokens": 20,
                                       "gap_s": 0.1}) for i, n in enumerate((500, 1000, 2100))) + "\n")
    err = bench_cli.check_args(["--scenario", "cpu-tiny", "--trace", str(p)])
    assert err and "line 3" in err and "2,120" in err


def test_the_default_scenarios_fit_their_engines():
    for name in SCENARIOS:
        assert bench_cli.check_args(["--scenario", name]) is None, name


# ---- 5. unbounded waits -----------------------------------------------------------------

@pytest.mark.parametrize("value", ["inf", "nan", "0", "-1", "1e9"])
def test_snapshot_interval_must_be_finite_and_bounded(value):
    err = bench_cli.check_args(["--snapshot-interval", value])
    assert err and "--snapshot-interval" in err


@pytest.mark.parametrize("value", ["inf", "nan", "0", "1e9"])
def test_time_scale_must_be_finite_and_bounded(value):
    err = bench_cli.check_args(["--time-scale", value])
    assert err and "--time-scale" in err


@pytest.mark.parametrize("value", ["inf", "nan", "0", "-5"])
def test_step_timeout_must_be_finite(value):
    err = bench_cli.check_args(["--step-timeout", value])
    assert err and "--step-timeout" in err


def test_the_step_timeout_follows_the_workload():
    # a two-hour trace at scale 1 once hit a fixed 3,600 s timeout
    lines = [json.dumps({"session": "a", "turn": i, "input_tokens": 100 + 20 * i, "output_tokens": 10,
                         "gap_s": 1800.0}) for i in range(5)]
    wl = parse_trace(lines)
    t1 = runner.default_step_timeout(wl, 1.0)
    assert t1 > 5 * 1800.0
    assert runner.default_step_timeout(wl, 0.01) < t1  # the gaps scale with the run
    assert bench_cli.check_args(["--step-timeout", "90"]) is None


def test_a_step_past_its_timeout_is_a_clear_error(tmp_path, capsys):
    # the one session arrives 30 s into the step: a 0.5 s timeout cannot be met
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"session": "a", "turn": 0, "input_tokens": 100, "output_tokens": 4,
                             "gap_s": 30.0}) + "\n")
    rc, out = _main(capsys, ["--trace", str(p), "--time-scale", "1", "--step-timeout", "0.5", "--policies", "none",
                             "--out", str(tmp_path / "o"), "--no-progress", "--no-plots"])
    assert rc == 1
    assert "policy none: the step did not end within its timeout" in out and "Traceback" not in out


# ---- 6. flags that would be ignored -----------------------------------------------------

def test_kv_capacity_zero_is_refused():
    err = bench_cli.check_args(["--kv-capacity", "0"])
    assert err and "--kv-capacity" in err


@pytest.mark.parametrize("flag,value", [("--sessions", "4"), ("--turns", "3"), ("--first-prompt", "100"),
                                        ("--tool-result", "10"), ("--output", "5"), ("--tool-max", "9"),
                                        ("--arrival-spread", "2")])
def test_workload_shape_flags_are_refused_with_a_trace(tmp_path, flag, value):
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"session": "a", "turn": 0, "input_tokens": 100, "output_tokens": 10,
                             "gap_s": 0}) + "\n")
    err = bench_cli.check_args(["--trace", str(p), flag, value])
    assert err and flag in err and "--trace" in err
    assert bench_cli.check_args(["--trace", str(p), "--seed", "3", "--vocab", "900"]) is None


@pytest.mark.parametrize("extra,flag", [(["--profile", "cpu-vllm-tiny"], "--profile"),
                                        (["--kv-capacity", "4096"], "--kv-capacity"),
                                        (["--sim-engines", "2"], "--sim-engines")])
def test_simulator_flags_are_refused_with_engine_urls(extra, flag):
    err = bench_cli.check_args(["--engine", "http://127.0.0.1:1", *extra])
    assert err and flag in err and "--engine" in err


@pytest.mark.parametrize("flag", ["--router", "--model"])
def test_engine_flags_are_refused_with_the_simulator(flag):
    err = bench_cli.check_args([flag, "http://127.0.0.1:1" if flag == "--router" else "m"])
    assert err and flag in err and "--engine" in err


def test_time_scale_help_says_real_engines_are_not_scaled():
    text = bench_cli.build_parser().format_help()
    assert "real engines run at their own speed" in " ".join(text.split())


# ---- 7. the default cap sweep -----------------------------------------------------------

def test_default_cap_sweep_has_one_and_a_half_times_the_fit():
    parse = bench_cli.build_parser().parse_args
    heavy = build_workload(parse(["--scenario", "cpu-heavy"]), SCENARIOS["cpu-heavy"])
    assert default_caps(heavy, 2528) == [2, 3, 4]
    dflt = build_workload(parse([]), SCENARIOS["default"])
    assert default_caps(dflt, 131072) == [12, 18, 24]
    # every session fits: every cap the rule derives holds them all, which is no gate
    assert default_caps(dflt, 10 ** 9) == []


def test_real_engines_give_the_report_their_block_size(tmp_path, capsys):
    # /kvgate/usage names the engine's KV block: re-prefill then counts whole blocks only
    # (report.summarize's rule), as on the simulator; without it the block is unknown
    for usage, want in ((True, 32), (False, None)):
        out_dir = tmp_path / f"o{int(usage)}"
        with fake_engine(usage=usage) as (url, _):
            rc, out = _main(capsys, [*SMALL, "--policies", "none", "--engine", url, "--engine-kind", "sglang",
                                     "--out", str(out_dir)])
        assert rc == 0, out
        data = json.loads((out_dir / "bench.json").read_text())
        assert data["block_size"] == want


def test_a_snapshot_interval_past_the_staleness_bound_is_refused_before_running():
    # the poller would refuse it when the first gate policy starts, after the others ran
    err = bench_cli.check_args(["--snapshot-interval", "10", "--policies", "none,kvgate"])
    assert err and "--snapshot-interval" in err and "staleness_s" in err
    err = bench_cli.check_args(["--snapshot-interval", "2", "--policies", "none,kvgate[staleness_s=1]"])
    assert err and "kvgate[staleness_s=1]" in err
    assert bench_cli.check_args(["--snapshot-interval", "2", "--policies", "none,kvgate"]) is None
    assert bench_cli.check_args(["--snapshot-interval", "10", "--policies", "none,cap-2"]) is None


def test_the_bench_names_no_knob_the_gate_is_retiring():
    # growth_reserve, overcommit and wait_cost_* are leaving GateConfig: no default policy,
    # scenario or help text of the bench may name them (a kvgate[k=v] policy is checked against
    # GateConfig's fields when it runs, so it follows whatever the gate has)
    from pathlib import Path

    bench = Path(bench_cli.__file__).parent
    root = bench.parents[2]
    for path in [*bench.glob("*.py"), root / "benchmarks" / "real_vllm.py", root / "benchmarks" / "real_vllm.sh"]:
        text = path.read_text()
        for knob in ("growth_reserve", "overcommit", "wait_cost"):
            assert knob not in text, f"{path.name} names {knob}"
