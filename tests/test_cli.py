"""The kvgate command: argument errors, knob plumbing, status / top output, and pollers as
real processes (leader killed by pid, standby takes over; metrics endpoint)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import httpx
import pytest

import kvgate
from kvgate.cli import add_knob_arguments, build_parser, config_from_args, main
from kvgate.control.poller import leader_key
from _httphelpers import (
    FakeHTTP,
    RefusedPort,
    env_without_proxies,
    sglang_metrics,
    text,
    wait_until,
)
from conftest import free_port


def run_cli(*argv: str, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvgate.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, env=env or env_without_proxies())


# -- knobs ----------------------------------------------------------------------------------
def test_every_knob_has_a_flag():
    import argparse
    import dataclasses

    p = add_knob_arguments(argparse.ArgumentParser())
    flags = {a for act in p._actions for a in act.option_strings}
    for f in dataclasses.fields(kvgate.GateConfig):
        assert "--" + f.name.replace("_", "-") in flags, f.name


def test_flags_override_env_and_env_overrides_defaults():
    p = build_parser()
    args = p.parse_args(["status", "--redis", "redis://x", "--gate", "g", "--max-wait-s", "7",
                         "--no-residency", "--scope", "all"])
    cfg = config_from_args(args, env={"KVGATE_MAX_WAIT_S": "3", "KVGATE_HEADROOM": "0.5"})
    assert cfg.max_wait_s == 7.0 and cfg.headroom == 0.5 and cfg.residency is False and cfg.scope == "all"
    cfg = config_from_args(p.parse_args(["status"]), env={"KVGATE_MAX_WAIT_S": "3"})
    assert cfg.max_wait_s == 3.0 and cfg.residency is True


def test_flag_none_beats_env_for_the_decode_cap():
    p = build_parser()
    env = {"KVGATE_EXPECTED_DECODE_CAP": "512"}
    assert config_from_args(p.parse_args(["status"]), env=env).expected_decode_cap == 512
    args = p.parse_args(["status", "--expected-decode-cap", "none"])
    assert config_from_args(args, env=env).expected_decode_cap is None


@pytest.mark.parametrize("raw, level", [("info", "INFO"), ("Warning", "WARNING"), ("DEBUG", "DEBUG")])
def test_log_level_from_env_any_case(raw, level, monkeypatch):
    monkeypatch.setenv("KVGATE_LOG_LEVEL", raw)
    assert build_parser().parse_args(["status"]).log_level == level


def test_bad_log_level_from_env_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setenv("KVGATE_LOG_LEVEL", "verbose")
    with pytest.raises(SystemExit) as ei:
        main(["status", "--redis", "redis://127.0.0.1:1/0", "--gate", "g"])
    assert ei.value.code == 2
    assert "KVGATE_LOG_LEVEL='verbose'" in capsys.readouterr().err


def test_bad_knob_is_a_clear_error():
    p = build_parser()
    with pytest.raises(ValueError, match="headroom"):
        config_from_args(p.parse_args(["status", "--headroom", "2"]), env={})
    with pytest.raises(ValueError, match="--max-wait-s"):
        config_from_args(p.parse_args(["status", "--max-wait-s", "soon"]), env={})


# -- argument errors (exit code 2 and a message, no traceback) ---------------------------------
@pytest.mark.parametrize("argv, needle", [
    (["poller", "--redis", "redis://127.0.0.1:1/0", "--gate", "g"], "--router URL or at least one --engine"),
    (["poller", "--redis", "redis://127.0.0.1:1/0", "--gate", "g", "--router", "http://a", "--engine",
      "http://b"], "not allowed with"),
    (["poller", "--redis", "redis://127.0.0.1:1/0", "--gate", "g", "--engine", "http://b", "--interval", "0"],
     "must be > 0"),
    (["poller", "--redis", "redis://127.0.0.1:1/0", "--gate", "g", "--engine", "nope"], "scheme"),
    (["poller", "--redis", "redis://127.0.0.1:1/0", "--gate", "g", "--engine", "http://b", "--interval", "5",
      "--leader-ttl", "2"], "leader_ttl_s"),
    (["poller", "--gate", "g", "--engine", "http://b"], "--redis URL is required"),
    (["poller", "--redis", "redis://127.0.0.1:1/0", "--gate", "g", "--engine", "http://b", "--unhealthy-after",
      "0"], "--unhealthy-after"),
    (["status", "--redis", "redis://127.0.0.1:1/0"], "--gate NAME is required"),
    (["status", "--redis", "redis://127.0.0.1:1/0", "--gate", "bad name!"], "gate name"),
    (["status", "--redis", "redis://127.0.0.1:1/0", "--gate", "g", "--pressure-threshold", "1.5"],
     "pressure_threshold"),
    (["top", "--redis", "redis://127.0.0.1:1/0", "--gate", "g", "--iterations", "0"], "must be >= 1"),
    (["poller", "--redis", "redis://127.0.0.1:1/0", "--gate", "g", "--engine", "http://b", "--metrics-port",
      "70000"], "not a TCP port"),
    ([], "required"),
    (["status", "--redis", "http://127.0.0.1:1", "--gate", "g"], "--redis"),
])
def test_argument_errors(argv, needle, capsys, monkeypatch):
    monkeypatch.delenv("KVGATE_REDIS_URL", raising=False)
    monkeypatch.delenv("KVGATE_GATE", raising=False)
    with pytest.raises(SystemExit) as ei:
        main(argv)
    assert ei.value.code == 2
    assert needle in capsys.readouterr().err


def test_status_redis_down_is_a_message(capsys):
    with RefusedPort() as dead:
        rc = main(["status", "--redis", f"redis://127.0.0.1:{dead.port}/0", "--gate", "g", "--json"])
    assert rc == 1
    assert "cannot read gate 'g'" in capsys.readouterr().err


def test_bench_delegates_or_explains(capsys):
    with pytest.raises(SystemExit) as ei:
        main(["bench", "--help"])
    assert ei.value.code == 0
    out = capsys.readouterr().out
    assert "usage: kvgate bench" in out


# -- status / top against a real gate ---------------------------------------------------------
@pytest.fixture
def engine():
    s = FakeHTTP().start()
    s.route("GET", "/metrics", text(sglang_metrics(50_000, 10_000)))
    yield s
    s.stop()


@pytest.mark.redis_real
def test_status_json_and_rich(redis_url, engine, capsys):
    gate = kvgate.Gate.from_url(redis_url, gate="cli")
    gate.write_snapshot([kvgate.EngineState(engine_id=engine.url, capacity_tokens=50_000, used_tokens=10_000,
                                            url=engine.url)])
    assert main(["status", "--redis", redis_url, "--gate", "cli", "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["capacity"] == 50_000 and st["ceiling"] == 45_000 and st["degraded"] is False
    assert st["engines"][0]["id"] == engine.url and st["poller_leader"] is None
    assert main(["status", "--redis", redis_url, "--gate", "cli", "--headroom", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "engines" in out and engine.url in out and "25.00k" in out  # ceiling with the flag's headroom
    assert "prefill cost" not in out  # nothing measured it
    gate.write_snapshot([kvgate.EngineState(engine_id=engine.url, capacity_tokens=50_000, used_tokens=10_000,
                                            url=engine.url, prefill_s_per_token=2.5e-4, prefill_load=0.42)])
    assert main(["status", "--redis", redis_url, "--gate", "cli"]) == 0
    out = capsys.readouterr().out
    assert "250.0 us/token" in out and "load 0.42" in out
    assert "tool gap" not in out  # no client reported one yet
    for i in range(8):  # eight turns whose sessions were away 0.3 s
        gate._eval(gate._flows.eval_op("acquire", {"ticket": f"t{i}", "session": f"s{i}", "need": 1, "prompt": 1, "protected": 1,
                                             "gap": 300}))
    assert main(["status", "--redis", redis_url, "--gate", "cli"]) == 0
    assert "tool gap" in (out := capsys.readouterr().out) and "0.300 s" in out
    assert "budget scale" in out and "1.00 x" in out  # no measured scale yet: the seeds' ledger


@pytest.mark.redis_real
def test_top_refreshes_a_bounded_number_of_times(redis_url):
    gate = kvgate.Gate.from_url(redis_url, gate="topg")
    gate.write_snapshot([kvgate.EngineState(engine_id="e1", capacity_tokens=1000, used_tokens=900)])
    r = run_cli("top", "--redis", redis_url, "--gate", "topg", "--iterations", "3", "--refresh", "0.1")
    assert r.returncode == 0, r.stderr
    assert "kvgate top topg" in r.stdout and "e1" in r.stdout


# -- pollers as processes -----------------------------------------------------------------------
def _start_poller(redis_url: str, gate: str, *extra: str, log_level: str = "WARNING") -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "kvgate.cli", "--log-level", log_level, "poller", "--redis", redis_url,
         "--gate", gate, "--interval", "0.2", "--leader-ttl", "1.0", "--http-timeout", "0.5", *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env_without_proxies())


class _StderrLines:
    """Collects a child's stderr lines on a thread (the poller logs its leadership changes:
    "poller <host:pid:id> is now LEADER" / "... is now standby")."""

    def __init__(self, proc: subprocess.Popen):
        self.lines: list[str] = []
        self._t = threading.Thread(target=self._read, args=(proc.stderr,), daemon=True)
        self._t.start()

    def _read(self, stream) -> None:
        for raw in iter(stream.readline, b""):
            self.lines.append(raw.decode(errors="replace").rstrip())

    def leadership(self, pid: int) -> list[str]:
        """The leadership changes the poller with this pid logged, in order."""
        out = []
        for ln in list(self.lines):
            if f":{pid}:" in ln and " is now " in ln:
                out.append(ln.rsplit(" is now ", 1)[1].strip())
        return out


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def _leader_pid(client, gate: str) -> int | None:
    v = client.get(leader_key(gate))
    if v is None:
        return None
    return int(v.decode().split(":")[1])  # identity is host:pid:random


@pytest.mark.redis_real
@pytest.mark.slow
def test_kill_leader_standby_takes_over(redis_url, engine):
    import redis as redis_lib

    r = redis_lib.Redis.from_url(redis_url)
    gate = kvgate.Gate.from_url(redis_url, gate="ha", config=kvgate.GateConfig(staleness_s=3.0))
    procs = [_start_poller(redis_url, "ha", "--engine", engine.url) for _ in range(2)]
    try:
        leader = wait_until(lambda: _leader_pid(r, "ha"), timeout=20)
        assert leader in {p.pid for p in procs}
        wait_until(lambda: not gate.status()["degraded"], timeout=10)
        dead = next(p for p in procs if p.pid == leader)
        standby = next(p for p in procs if p.pid != leader)
        os.kill(dead.pid, signal.SIGKILL)
        dead.wait(timeout=10)
        killed_at_ts = int(r.hget(gate.key("snapshot"), "ts_ms"))
        wait_until(lambda: _leader_pid(r, "ha") == standby.pid, timeout=15)
        # the new leader writes: the snapshot's timestamp moves past the kill and stays fresh
        wait_until(lambda: int(r.hget(gate.key("snapshot"), "ts_ms")) > killed_at_ts + 500, timeout=10)
        st = gate.status()
        assert not st["degraded"] and st["capacity"] == 50_000
        assert standby.poll() is None
    finally:
        for p in procs:
            _stop(p)


@pytest.mark.redis_real
@pytest.mark.slow
def test_sigterm_releases_lease_and_metrics_endpoint(redis_url, engine):
    import redis as redis_lib

    r = redis_lib.Redis.from_url(redis_url)
    port = free_port()
    p = _start_poller(redis_url, "mp", "--engine", engine.url, "--metrics-port", str(port))
    try:
        wait_until(lambda: _leader_pid(r, "mp") == p.pid, timeout=20)

        def scrape():
            try:
                body = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2, trust_env=False).text
            except httpx.HTTPError:
                return None
            return body if "kvgate_poller_writes_total" in body else None

        body = wait_until(scrape, timeout=15)
        assert 'kvgate_poller_leader{gate="mp"' in body
        assert "kvgate_poller_scrapes_bridged_total" in body
        assert "kvgate_ceiling_tokens" in body  # the lead's GateCollector in the same registry
        os.kill(p.pid, signal.SIGTERM)
        assert p.wait(timeout=15) == 0
        assert r.get(leader_key("mp")) is None  # released, not left to expire
    finally:
        _stop(p)


@pytest.mark.redis_real
@pytest.mark.slow
def test_paused_leader_loses_the_lease_and_does_not_take_it_back(redis_url, engine):
    import redis as redis_lib

    r = redis_lib.Redis.from_url(redis_url)
    gate = kvgate.Gate.from_url(redis_url, gate="stall")
    procs = [_start_poller(redis_url, "stall", "--engine", engine.url, log_level="INFO") for _ in range(2)]
    logs = {p.pid: _StderrLines(p) for p in procs}
    try:
        leader = wait_until(lambda: _leader_pid(r, "stall"), timeout=20)
        standby = next(p.pid for p in procs if p.pid != leader)
        wait_until(lambda: logs[leader].leadership(leader) == ["LEADER"], timeout=10, what="the leader's log")
        os.kill(leader, signal.SIGSTOP)  # a stalled leader (GC pause, swapped out, ...)
        try:
            wait_until(lambda: _leader_pid(r, "stall") == standby, timeout=15)
        finally:
            os.kill(leader, signal.SIGCONT)
        # the old leader's first tick after the pause: its extend fails, its acquire loses,
        # and it says so (a bounded wait for that event, not a sleep standing in for it)
        wait_until(lambda: "standby" in logs[leader].leadership(leader), timeout=20,
                   what="the resumed leader to notice it lost the lease")
        # and the new leader keeps writing: two more of its snapshots after that
        # the new leader may not have written yet: wait for its first snapshot before reading it
        wait_until(lambda: r.hget(gate.key("snapshot"), "ts_ms") is not None, timeout=10)
        ts = int(r.hget(gate.key("snapshot"), "ts_ms"))
        wait_until(lambda: int(r.hget(gate.key("snapshot"), "ts_ms")) > ts, timeout=10)
        ts = int(r.hget(gate.key("snapshot"), "ts_ms"))
        wait_until(lambda: int(r.hget(gate.key("snapshot"), "ts_ms")) > ts, timeout=10)
        assert _leader_pid(r, "stall") == standby
        assert logs[leader].leadership(leader) == ["LEADER", "standby"]  # it never took the lease back
        assert all(p.poll() is None for p in procs)
    finally:
        for p in procs:
            _stop(p)
        gate.close()


def test_poller_dry_run_prints_states_without_redis(engine, capsys):
    refused_engine, refused_redis = RefusedPort(), RefusedPort()
    dead = refused_engine.url
    try:
        rc = main(["poller", "--redis", f"redis://127.0.0.1:{refused_redis.port}/0", "--gate", "g",
                   "--engine", engine.url, "--engine", dead, "--http-timeout", "0.5", "--dry-run"])
    finally:
        refused_redis.close()
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["would_write"] and out["source"] == "static"
    eng = {e["engine_id"]: e for e in out["engines"]}
    assert eng[engine.url]["cap"] == 50_000 and eng[engine.url]["healthy"] == 1
    assert eng[dead]["healthy"] == 0 and dead in out["errors"]
    try:
        rc = main(["poller", "--redis", "redis://127.0.0.1:1/0", "--gate", "g", "--engine", dead,
                   "--http-timeout", "0.5", "--dry-run"])
    finally:
        refused_engine.close()
    assert rc == 1 and json.loads(capsys.readouterr().out)["reason"] == "no_healthy_engine"


def test_top_with_redis_down_keeps_refreshing_and_says_why():
    with RefusedPort() as dead:
        r = run_cli("top", "--redis", f"redis://127.0.0.1:{dead.port}/0", "--gate", "g", "--iterations", "2",
                    "--refresh", "0.1", "--redis-timeout-s", "0.2")
    assert r.returncode == 0, r.stderr
    assert "cannot read gate 'g'" in r.stdout


def test_bench_missing_module_is_a_clear_message(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "kvgate.tools.bench.cli", None)  # import now raises ImportError
    monkeypatch.delattr("kvgate.tools.bench.cli", raising=False)
    import kvgate.tools.bench as bench_pkg

    monkeypatch.delattr(bench_pkg, "cli", raising=False)
    assert main(["bench", "--anything"]) == 2
    assert "kvgate.tools.bench.cli is not available" in capsys.readouterr().err


# -- the runtime install: no rich, no bench extra (the real install: tests/test_packaging.py) ----
def test_bench_without_its_extra_names_the_install_and_runs_nothing(monkeypatch, capsys, tmp_path):
    import kvgate.tools

    monkeypatch.setattr(kvgate.tools, "missing_bench_modules", lambda: ["rich", "matplotlib"])
    assert main(["bench", "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "rich, matplotlib missing" in err and "pip install 'kvgate[bench]'" in err
    assert not (tmp_path / "o").exists()


@pytest.mark.redis_real
def test_status_and_top_print_plain_text_without_rich(redis_url, monkeypatch, capsys):
    import kvgate.control.status

    gate = kvgate.Gate.from_url(redis_url, gate="plain")
    gate.write_snapshot([kvgate.EngineState(engine_id="e1", capacity_tokens=50_000, used_tokens=10_000)])
    monkeypatch.setattr(kvgate.control.status, "have_rich", lambda: False)
    assert main(["status", "--redis", redis_url, "--gate", "plain", "--headroom", "0.5"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == "kvgate plain"
    assert "ledger" in out and any(ln.split()[:5] == ["ledger", "0", "/", "25.00k", "reserved"] for ln in lines)
    # the engines as columns under their header
    header = lines.index(next(ln for ln in lines if ln.split()[:3] == ["engine", "kind", "healthy"]))
    assert lines[header + 1].split()[:5] == ["e1", "sglang", "yes", "50.00k", "10.00k"]
    assert "━" not in out and "╭" not in out
    assert main(["top", "--redis", redis_url, "--gate", "plain", "--iterations", "2", "--refresh", "0.05"]) == 0
    out = capsys.readouterr().out
    assert out.count("kvgate top plain") == 2 and "━" not in out
