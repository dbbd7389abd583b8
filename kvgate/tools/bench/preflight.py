"""Everything ``kvgate bench`` checks before anything runs, and the plan of each scenario's run.

A bad argument is a one-line ValueError (the CLI prints it and exits 2) before any engine,
Redis or output file is touched: flags that contradict each other or would be ignored,
workloads the engines would refuse, URLs that do not parse or do not answer, an output
directory that cannot be written.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvgate.knob_flags import config_from_args

from .engines import make_client
from .environments import EngineEnv, RealEnv, SimEnv
from .flags import DEFAULT_POLICIES, MATRIX_POLICIES, SIM_FLAGS, WORKLOAD_FLAGS, flag_name, matrix_policies
from .policies import Policy, parse_policies, scaled_gate_config, split_policies
from .scenarios import SCENARIOS, Scenario, build_workload
from .sweep import CapSweep, default_caps, parse_caps
from .workload import MAX_REQUEST_TOKENS, Workload

__all__ = ["Plan", "prepare", "check_fits", "check_sim_fits", "check_redis_url", "ping_redis", "check_out_dir",
           "make_out_dir", "check_http_url", "base_gate_config", "MAX_TIME_SCALE", "MAX_SNAPSHOT_INTERVAL_S",
           "PROBE_TIMEOUT_S"]

MAX_TIME_SCALE = 100.0
MAX_SNAPSHOT_INTERVAL_S = 60.0
#: the bound on each check of an engine or Redis before the run (per call, s)
PROBE_TIMEOUT_S = 5.0
# the files a run writes into --out (summary.write_json, plots.write_plots)
_OUT_FILES = ("bench.json",)
_PLOT_FILES = ("hit_rate_over_time.png", "latency_by_turn.png")


@dataclass
class Plan:
    """One scenario's run, checked: its workload, engines, policies and cap sweep."""

    name: str  # the scenario's name
    scenario: Scenario
    time_scale: float
    snapshot_interval_s: float
    workload: Workload
    env: EngineEnv | None  # None for real engines until they were asked (probe=False)
    pool: int | None  # tokens, where known
    policies: list[Policy]
    sweep: CapSweep
    base_cfg: Any  # GateConfig


def prepare(args: argparse.Namespace, probe: bool) -> list[Plan]:
    """Check every argument and plan each scenario's run: one plan, or with ``--matrix`` one
    per scenario. Everything that needs no engine and no Redis is checked first;
    ``probe=False`` stops there (the pool of real engines is then unknown, so their default
    caps are a placeholder). ``probe=True`` then asks the engines (they must answer; what they
    say bounds the workload), pings ``--redis`` when a gate policy will use it, and creates
    ``--out``. Raises ValueError; nothing has run by then."""
    if isinstance(args.rounds, bool) or not isinstance(args.rounds, int) or args.rounds < 1:
        raise ValueError(f"--rounds must be an integer >= 1, got {args.rounds!r}")
    steps = getattr(args, "steps", 1)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"--steps must be an integer >= 1, got {steps!r}")
    step_timeout = getattr(args, "step_timeout", None)
    if step_timeout is not None and not (math.isfinite(step_timeout) and step_timeout > 0):
        raise ValueError(f"--step-timeout must be a finite number of seconds > 0, got {step_timeout}")
    if (getattr(args, "embedded_redis", "auto") == "redis-server" and not args.redis
            and shutil.which("redis-server") is None):
        raise ValueError("--embedded-redis redis-server: no redis-server binary on PATH "
                         "(install it, or use --embedded-redis fakeredis or --redis URL)")
    if args.redis:
        check_redis_url(args.redis)
    _check_flag_combinations(args)
    check_out_dir(args.out, plots=not args.no_plots and not args.matrix)
    base_cfg = base_gate_config(args)  # validated even when no gate policy runs: bad flags are errors
    if args.matrix:
        plans = [_plan(args, name, matrix_policies(SCENARIOS[name]), base_cfg) for name in matrix_scenarios(args)]
    else:
        plans = [_plan(args, args.scenario, args.policies or DEFAULT_POLICIES, base_cfg)]
    if probe:
        for plan in plans:
            if args.engine:
                _probe_engines(args, plan)
        if args.redis and any(p.kind == "gate" for plan in plans for p in plan.policies):
            ping_redis(args.redis)
        make_out_dir(args.out)
    return plans


def matrix_scenarios(args: argparse.Namespace) -> list[str]:
    """The scenarios of ``--matrix``: ``--scenarios`` in its order, else every named one."""
    if not args.scenarios:
        return list(SCENARIOS)
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown or not names:
        raise ValueError(f"--scenarios {args.scenarios}: unknown scenario(s) {', '.join(unknown) or '(none given)'}; "
                         f"known: {', '.join(SCENARIOS)}")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"--scenarios {args.scenarios}: {', '.join(dup)} given twice")
    return names


def _plan(args: argparse.Namespace, name: str, policies_text: str, base_cfg: Any) -> Plan:
    """The plan of scenario ``name`` under ``args``, checked without asking any engine."""
    sc = SCENARIOS[name]
    time_scale = args.time_scale if args.time_scale is not None else (1.0 if args.engine else sc.time_scale)
    if not (math.isfinite(time_scale) and 0 < time_scale <= MAX_TIME_SCALE):
        raise ValueError(f"--time-scale must be a number in (0, {MAX_TIME_SCALE:g}], got {time_scale}")
    interval = args.snapshot_interval
    if interval is None:
        interval = min(MAX_SNAPSHOT_INTERVAL_S, max(0.05, 1.0 * time_scale))
    if not (math.isfinite(interval) and 0 < interval <= MAX_SNAPSHOT_INTERVAL_S):
        raise ValueError(f"--snapshot-interval must be a number of seconds in (0, {MAX_SNAPSHOT_INTERVAL_S:g}], "
                         f"got {interval}")
    workload = build_workload(args, sc)
    check_fits(workload, MAX_REQUEST_TOKENS, "the bench")
    env: EngineEnv | None = None
    pool = None
    if args.engine:
        for flag, urls in (("--engine", args.engine), ("--router", [args.router] if args.router else [])):
            for u in urls:
                check_http_url(flag, u)
        make_client(args.engine_kind, args.engine, args.engine)  # validates the URLs
    else:
        engines = args.sim_engines if args.sim_engines is not None else sc.engines
        if engines < 1:
            raise ValueError("--sim-engines must be >= 1")
        env = SimEnv(args.profile or sc.profile, engines, time_scale,
                     args.kv_capacity if args.kv_capacity is not None else sc.kv_capacity,
                     prefill_metrics=args.sim_prefill_metrics is not False)
        check_sim_fits(workload, env, vocab_given=args.vocab is not None)
        pool = env.pool_tokens
    sweep = _sweep(args, policies_text, workload, pool)
    policies = parse_policies(policies_text, sweep.caps)
    for p in policies:  # a policy's own knobs are checked now, not when its turn comes
        if p.kind == "gate":
            cfg = scaled_gate_config(base_cfg, p, time_scale)
            # the poller refuses an interval at or past the staleness bound (every snapshot
            # would read stale before the next one and every turn would bypass as degraded)
            if interval >= cfg.staleness_s:
                raise ValueError(f"--snapshot-interval ({interval:g} s) must be below the "
                                 f"staleness_s of policy {p.name} ({cfg.staleness_s:g} s)")
    return Plan(name=name, scenario=sc, time_scale=time_scale, snapshot_interval_s=interval, workload=workload,
                env=env, pool=pool, policies=policies, sweep=sweep, base_cfg=base_cfg)


def _sweep(args: argparse.Namespace, policies_text: str, workload: Workload, pool: int | None) -> CapSweep:
    """The cap sweep: ``--caps`` as given (no widening), else derived from the pool, widening
    where the policies hold the sweep (``cap``)."""
    n = len(workload.sessions)
    if args.caps:
        return CapSweep(parse_caps(args.caps), n, widen=False)
    sweeping = any(item.strip() == "cap" for item in split_policies(policies_text))
    return CapSweep(default_caps(workload, pool), n, widen=sweeping)


def _probe_engines(args: argparse.Namespace, plan: Plan) -> None:
    """Ask the real engines: they must answer; their limits bound the workload, and their
    pool sets the default caps."""
    env = RealEnv(args.engine_kind, args.engine, args.router, args.model)
    plan.pool = asyncio.run(env.probe_pool(PROBE_TIMEOUT_S))
    plan.env = env
    limit = env.request_limit()
    if limit is not None:
        check_fits(plan.workload, *limit)
    if not args.caps:
        plan.sweep = CapSweep(default_caps(plan.workload, plan.pool), plan.sweep.sessions, widen=plan.sweep.widen)
        plan.policies = parse_policies(args.policies or DEFAULT_POLICIES, plan.sweep.caps)


def base_gate_config(args: argparse.Namespace) -> Any:
    """GateConfig for the gate policies: defaults < ``KVGATE_*`` environment < knob flags <
    ``--knob NAME=VALUE``. ValueError on an unknown knob or a bad value."""
    from kvgate.config import parse_value

    cfg = config_from_args(args)
    kw = {}
    for item in args.knob:
        name, sep, val = item.partition("=")
        if not sep or not name:
            raise ValueError(f"--knob expects NAME=VALUE, got {item!r}")
        kw[name.strip()] = parse_value(name.strip(), val, f"--knob {name.strip()}")
    # parse_value rejects unknown names; replace() validates the values against each other
    return replace(cfg, **kw) if kw else cfg


def _check_flag_combinations(args: argparse.Namespace) -> None:
    """Flags a run would ignore, or that contradict each other, are errors, not silently dropped."""
    if args.matrix:
        given = [flag for flag, on in (("--scenario", getattr(args, "scenario_given", False)),
                                       ("--policies", args.policies is not None), ("--caps", bool(args.caps)),
                                       ("--trace", bool(args.trace)), ("--engine", bool(args.engine)))
                 if on]
        if given:
            raise ValueError(f"{', '.join(given)} cannot be used with --matrix: it runs every scenario "
                             f"(--scenarios A,B to choose) on the simulator with {MATRIX_POLICIES} and each "
                             f"scenario's own cap sweep")
    elif args.scenarios:
        raise ValueError("--scenarios applies to --matrix; one scenario is --scenario NAME")
    if args.trace:
        given = [flag_name(dest) for dest, _ in WORKLOAD_FLAGS if getattr(args, dest, None) is not None]
        if given:
            raise ValueError(f"{', '.join(given)} cannot be used with --trace: the trace's lines give its "
                             f"sessions, turns, token counts and gaps")
    if args.engine:
        given = [flag_name(dest) for dest, _ in SIM_FLAGS if getattr(args, dest) is not None]
        if args.sim_prefill_metrics is not None:
            given.append("--sim-prefill-metrics" if args.sim_prefill_metrics else "--no-sim-prefill-metrics")
        if given:
            raise ValueError(f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to the simulator, "
                             f"not to --engine URLs")
    else:
        given = [flag for flag, dest in (("--router", "router"), ("--model", "model"))
                 if getattr(args, dest) is not None]
        if given:
            raise ValueError(f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to --engine URLs, "
                             f"not to the simulator")


def check_http_url(flag: str, url: str) -> None:
    """ValueError unless ``url`` passes the project's one engine-URL rule
    (``kvgate._urls.normalize_base_url``: http(s), a host, a port in range, no credentials,
    query or control characters) and names a port an engine could listen on."""
    from urllib.parse import urlsplit

    from kvgate._urls import normalize_base_url

    try:
        normalize_base_url(url)
    except ValueError as e:
        raise ValueError(f"{flag} {url}: {e}") from None
    if urlsplit(url.strip()).port == 0:
        raise ValueError(f"{flag} {url}: port 0 is not a port an engine listens on")


def _redact(url: str) -> str:
    """A Redis URL with its password replaced by ``***``."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        parts = urlsplit(url)
        if parts.password:
            host = parts.netloc.rsplit("@", 1)[-1]
            return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))
    except ValueError:
        pass
    return url


def check_redis_url(url: str) -> None:
    """ValueError unless redis-py can parse ``url`` (scheme redis://, rediss:// or unix://)."""
    from redis.connection import parse_url

    try:
        parse_url(url)
    except (ValueError, TypeError) as e:
        raise ValueError(f"--redis {_redact(url)}: {e}") from None


def ping_redis(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """ValueError unless the Redis at ``url`` answers PING; bounded by ``timeout_s`` for the
    connection and the answer, and as a whole (a name lookup is not bounded by socket
    timeouts: the ping runs in a thread that is abandoned after ``2 * timeout_s + 1``)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    result: dict = {}

    def ping() -> None:
        try:
            client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s,
                                          retry=Retry(NoBackoff(), 0))
            try:
                client.ping()
            finally:
                client.close()
        except Exception as e:  # any failure is the answer: the run could not use it
            result["error"] = e
        else:
            result["ok"] = True

    t = threading.Thread(target=ping, name="kvgate-bench-redis-ping", daemon=True)
    t.start()
    t.join(2 * timeout_s + 1)
    if result.get("ok"):
        return
    err = result.get("error")
    why = f"{type(err).__name__}: {err}" if err is not None else f"no answer within {2 * timeout_s + 1:g} s"
    from urllib.parse import urlsplit

    with contextlib.suppress(ValueError):
        pw = urlsplit(url).password
        if pw:
            why = why.replace(pw, "***")
    raise ValueError(f"--redis {_redact(url)}: no answer to PING ({why})")


def check_out_dir(path: str, plots: bool = True) -> None:
    """ValueError unless ``--out`` is a writable directory or can be created (touches nothing)."""
    p = Path(path).absolute()
    if p.exists() and not p.is_dir():
        raise ValueError(f"--out {path}: exists and is not a directory")
    if p.is_dir():
        if not os.access(p, os.W_OK | os.X_OK):
            raise ValueError(f"--out {path}: the directory is not writable")
        for name in _OUT_FILES + (_PLOT_FILES if plots else ()):
            if (p / name).is_dir():
                raise ValueError(f"--out {path}: {name} there is a directory; the bench writes a file of that name")
        return
    a = p
    while not a.exists() and a != a.parent:
        a = a.parent
    if not a.is_dir():
        raise ValueError(f"--out {path}: cannot be created, {a} is not a directory")
    if not os.access(a, os.W_OK | os.X_OK):
        raise ValueError(f"--out {path}: cannot be created, {a} is not writable")


def make_out_dir(path: str) -> None:
    """Create ``--out`` and write a file in it, before the run (ValueError if either fails)."""
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=p, prefix=".kvgate-bench-write-test-"):
            pass
    except OSError as e:
        raise ValueError(f"--out {path}: cannot write there ({e.strerror or e})") from None


def check_fits(workload: Workload, limit: int, why: str) -> None:
    """ValueError naming the turn (or the trace line) that asks one engine for more than
    ``limit`` tokens (prompt + output): the engine would refuse it on every policy."""
    tokens, where = workload.largest_request()
    if tokens <= limit:
        return
    trace = workload.spec.get("trace")
    if trace is not None:
        raise ValueError(f"{trace}: {where}: input_tokens + output_tokens = {tokens:,}, but {why} allows at "
                         f"most {limit:,}: the engine would refuse that turn")
    raise ValueError(f"{where} needs {tokens:,} tokens (prompt + output), but {why} allows at most "
                     f"{limit:,}: use fewer --turns or a shorter --first-prompt, --tool-result or --output")


def check_sim_fits(workload: Workload, env: "SimEnv", vocab_given: bool) -> None:
    """The workload against the simulator's profile: its largest request and its token ids."""
    check_fits(workload, *env.request_limit())
    v = env.profile.vocab_size
    if workload.vocab > v:
        src = "--vocab" if vocab_given else "the scenario's vocabulary"
        raise ValueError(f"token ids are drawn below {workload.vocab:,} ({src}), but profile {env.profile.name} "
                         f"has a vocabulary of {v:,} ids: the engine would refuse every turn")
