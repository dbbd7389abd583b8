"""``kvgate bench``: run one seeded agentic workload through several policies, side by side.

``add_arguments(parser)`` and ``run(args) -> int`` are called by ``kvgate/cli.py``;
``python -m kvgate.tools.bench`` calls :func:`main`.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, AsyncIterator, Sequence

from redis.exceptions import RedisError
from rich.markup import escape

from ...config import parse_value
from .engines import EngineClient, make_client
from .host import describe as describe_host
from .host import summary_line as host_line
from .report import (SIM_FLAGS, WORKLOAD_FLAGS, checks, combine_rounds, render_table, round_lag_warnings, summarize,
                     write_json, write_plots)
from .runner import EngineEnv, Policy, parse_policies, run_policy, scaled_gate_config
from .workload import (MAX_REQUEST_TOKENS, VOCAB_DEFAULT, ToolLatency, Workload, WorkloadSpec, generate, load_trace,
                       parse_range)

__all__ = ["add_arguments", "run", "main", "SCENARIOS", "STEP_KNOBS", "ENGINE_BOUND_STEP_KNOBS", "default_policies", "build_parser"]


@dataclass(frozen=True)
class Scenario:
    """Defaults of a named scenario; every value can be overridden by a flag."""

    description: str
    profile: str
    sessions: int
    turns: str
    first_prompt: str
    tool_result: str
    output: str
    time_scale: float
    engines: int = 1
    kv_capacity: int | None = None  # override the profile's pool (tokens)
    arrival_spread_s: float = 0.0
    tool: ToolLatency = ToolLatency()
    vocab: int | None = None  # token ids are drawn below this (None: the engine's, capped)
    # knobs of a second full-gate policy in the default list, sized to this scenario's rollout
    # step (docs/benchmark-runs.md#step-sized); None: the default list has `kvgate` alone
    step_knobs: str | None = None


# The CPU vLLM measurements of ENGINES.md: one lognormal, median 0.2 s, p90 1.5 s.
_CPU_TOOL = ToolLatency(fast_median_s=0.2, slow_median_s=1.5, slow_frac=0.0,
                        sigma=math.log(1.5 / 0.2) / 1.2816, max_s=10.0)

# The knobs docs/knobs.md recommends for a rollout step whose sessions all start at once and
# must wait longer than the seeds' 30 s max_wait_s for a place: a bound of the order of a
# session's life (the default scenario's sessions live ~100-200 s of model time; on slow boxes
# the cpu-heavy ones wait ~60 s behind the best cap's first waves) and a window reserving for
# the history's growth.
STEP_KNOBS = "max_wait_s=240,growth_reserve=2"

# For an engine-bound pool (the heavier CPU model: a pool that holds two or three grown
# sessions), windows may also outgrow the pool by 30 % before any is revoked, as the
# best cap's sessions do (docs/decisions.md#overcommit). Measured within 10 % of the best cap
# on the slow, between and fast classes; not on the GPU scenarios, where it costs hit rate.
ENGINE_BOUND_STEP_KNOBS = STEP_KNOBS + ",overcommit=1.3"
BASE_POLICIES = "none,cap,admission,residency,kvgate"


def default_policies(sc: Scenario, trace: bool = False) -> str:
    """The policies a run compares when ``--policies`` is not given: every kind once, plus the
    full gate with the scenario's step-sized knobs where it has them (not for a trace replay,
    whose sessions are not the scenario's)."""
    return BASE_POLICIES + (f",kvgate[{sc.step_knobs}]" if sc.step_knobs and not trace else "")


SCENARIOS: dict[str, Scenario] = {
    # Working set several times the pool: the regime kvgate exists for.
    "default": Scenario(
        description="KV pressure: the sessions' final contexts add up to ~3x the KV pool",
        profile="gpu-h100-30b", sessions=40, turns="16-32", first_prompt="1500-2500",
        tool_result="100-400", output="30-120", time_scale=0.02, step_knobs=STEP_KNOBS),
    # Context sizes of the published agent traces: the thoughtworks agentic-coding-trajectories
    # card gives a p50 deepest prompt of ~24k tokens; these sessions end at ~24k on average.
    # Re-prefill is expensive here (a 16k-token prefill is 1.6 s on the GPU profile).
    "long-context": Scenario(
        description="KV pressure with trace-sized contexts: 16 sessions ending at ~24k tokens (~2.9x the pool)",
        profile="gpu-h100-30b", sessions=16, turns="16-32", first_prompt="6000-10000",
        tool_result="300-800", output="50-150", time_scale=0.02, step_knobs=STEP_KNOBS),
    # Same session shapes, few enough that every context stays resident.
    "no-pressure": Scenario(
        description="no KV pressure: every session's context fits in the pool at once",
        profile="gpu-h100-30b", sessions=6, turns="16-32", first_prompt="1500-2500",
        tool_result="100-400", output="30-120", time_scale=0.05),
    # The shapes of the real CPU vLLM measurements (ENGINES.md), on the fitted profiles.
    "cpu-tiny": Scenario(
        description="12 sessions x 12 turns on an 80-block (2,560-token) cache, tiny CPU model profile",
        profile="cpu-vllm-tiny", sessions=12, turns="12", first_prompt="250-350", tool_result="30-60",
        output="20-30", time_scale=1.0, tool=_CPU_TOOL, vocab=1000),
    "cpu-heavy": Scenario(
        description="12 sessions x 12 turns on an 80-block (2,560-token) cache, heavier CPU model profile",
        profile="cpu-vllm-heavy", sessions=12, turns="12", first_prompt="250-350", tool_result="30-60",
        output="20-30", time_scale=1.0, tool=_CPU_TOOL, vocab=1000, step_knobs=ENGINE_BOUND_STEP_KNOBS),
}


def _knob_hooks():
    """``kvgate.cli.add_knob_arguments`` / ``config_from_args`` when the main CLI has them."""
    try:
        from kvgate import cli as main_cli
    except Exception:
        return None, None
    return getattr(main_cli, "add_knob_arguments", None), getattr(main_cli, "config_from_args", None)


def add_arguments(p: argparse.ArgumentParser) -> None:
    sc = p.add_argument_group("scenario and workload")
    sc.add_argument("--scenario", choices=sorted(SCENARIOS), default="default",
                    help="named defaults for the workload and engines (default: %(default)s)")
    sc.add_argument("--list-scenarios", action="store_true", help="print the scenarios and exit")
    sc.add_argument("--seed", type=int, default=0, help="workload seed (default: %(default)s)")
    sc.add_argument("--sessions", type=int, help="number of sessions")
    sc.add_argument("--turns", help="turns per session: N or LO-HI (uniform)")
    sc.add_argument("--first-prompt", help="first prompt tokens: N or LO-HI")
    sc.add_argument("--tool-result", help="tool result tokens appended per turn: N or LO-HI")
    sc.add_argument("--output", help="output tokens per turn (max_new_tokens): N or LO-HI")
    sc.add_argument("--tool-fast-median", type=float, help="median of fast tool calls, s")
    sc.add_argument("--tool-slow-median", type=float, help="median of slow tool calls, s")
    sc.add_argument("--tool-slow-frac", type=float, help="fraction of slow tool calls")
    sc.add_argument("--tool-sigma", type=float, help="log-space spread of tool latency")
    sc.add_argument("--tool-max", type=float, help="tool timeout: latency cap, s")
    sc.add_argument("--arrival-spread", type=float, help="sessions arrive uniformly over this many s")
    sc.add_argument("--vocab", type=int, help="token ids are drawn below this (default: the scenario's, "
                    "else the simulator profile's capped at 32000, else 32000; give the model's "
                    "vocabulary size for real engines)")
    sc.add_argument("--trace", help="replay a JSONL trace instead of generating sessions")
    sc.add_argument("--time-scale", type=float,
                    help="multiply every duration (tool latency, the simulator's engine cost, gate time "
                         "knobs) by this, in (0, 100]; with --engine only the tool latency and the knobs "
                         "scale: real engines run at their own speed (default: the scenario's; 1 with --engine)")
    sc.add_argument("--no-scale-knobs", action="store_true",
                    help="do not scale the gate's time knobs with --time-scale")

    pol = p.add_argument_group("policies")
    pol.add_argument("--policies",
                     help="comma list of none, cap (sweep --caps), cap-N, turncap-N, admission, residency, "
                          "kvgate; a gate policy may set its own knobs, e.g. 'kvgate[max_wait_s=600]' "
                          f"(default: {BASE_POLICIES}, and without --trace on the default and long-context "
                          f"scenarios also kvgate[{STEP_KNOBS}], on cpu-heavy kvgate[{ENGINE_BOUND_STEP_KNOBS}]: "
                          f"the knobs sized to their rollout step)")
    pol.add_argument("--caps", help="caps to sweep for 'cap', e.g. 4,8,16 (default: derived from the pool: "
                                    "one, one and a half and two times the sessions whose final context fits)")
    pol.add_argument("--rounds", type=int, default=1,
                     help="run every policy this many times, interleaved (round 1 runs each policy once, "
                          "then round 2, ...), and report each policy's median; the checks read the "
                          "medians of the per-round ratios (default: %(default)s)")

    eng = p.add_argument_group("engines")
    eng.add_argument("--profile", help="simulator profile name or JSON path")
    eng.add_argument("--sim-engines", type=int, help="simulated engines behind the router")
    eng.add_argument("--kv-capacity", type=int, help="override the profile's KV pool per engine (tokens)")
    eng.add_argument("--sim-prefill-metrics", action="store_true",
                     help="the simulator exports its prefill time (SGLang does not), so the gate's "
                          "prefill-cost rules (wait_cost_*) run as on vLLM")
    eng.add_argument("--engine", nargs="+", metavar="URL",
                     help="real engine base URLs instead of the simulator")
    eng.add_argument("--engine-kind", choices=("vllm", "sglang"), default="vllm",
                     help="API of --engine URLs (default: %(default)s)")
    eng.add_argument("--router", help="SGLang router URL to send turns through (with --engine-kind sglang)")
    eng.add_argument("--model", help="model name for vLLM (default: the server's first model)")

    out = p.add_argument_group("redis and output")
    out.add_argument("--redis", help="Redis URL (default: a private embedded redis-server, else fakeredis)")
    out.add_argument("--embedded-redis", choices=("auto", "redis-server", "fakeredis"), default="auto")
    out.add_argument("--out", default="bench-out", help="output directory (default: %(default)s)")
    out.add_argument("--no-plots", action="store_true")
    out.add_argument("--no-progress", action="store_true")
    out.add_argument("--snapshot-interval", type=float, default=None,
                     help="seconds between poller ticks, at most 60 (default: 1 s x --time-scale, at least 0.05 s)")
    out.add_argument("--step-timeout", type=float, default=None, metavar="SECONDS",
                     help="stop a policy's step after this long, an error (default: derived from the "
                          "workload: its gaps added up x --time-scale, plus 10 s per turn, plus 600 s)")

    add_knobs, _ = _knob_hooks()
    if add_knobs is not None:
        try:
            add_knobs(p)
        except argparse.ArgumentError:
            pass
    p.add_argument("--knob", action="append", default=[], metavar="NAME=VALUE",
                   help="set a GateConfig knob for the gate policies (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvgate bench", description=__doc__.splitlines()[0])
    add_arguments(p)
    return p


def base_gate_config(args: argparse.Namespace) -> Any:
    import kvgate

    _, from_args = _knob_hooks()
    if from_args is not None and any(k.startswith("knob_") for k in vars(args)):
        cfg = from_args(args)  # defaults < KVGATE_* environment < knob flags; ValueError on bad input
    else:
        cfg = kvgate.GateConfig.from_env()
    kw = {}
    for item in args.knob:
        name, sep, val = item.partition("=")
        if not sep or not name:
            raise ValueError(f"--knob expects NAME=VALUE, got {item!r}")
        kw[name.strip()] = parse_value(name.strip(), val, f"--knob {name.strip()}")
    # parse_value rejects unknown names; replace() validates the values against each other
    return replace(cfg, **kw) if kw else cfg


def workload_vocab(args: argparse.Namespace, sc: Scenario) -> int:
    """Token ids are drawn below: ``--vocab``; else the scenario's (the CPU scenarios use the
    1,000-token vocabulary of ENGINES.md's dummy model); else, on the simulator, its profile's
    vocabulary capped at 32,000; else 32,000.  An id outside the engine's vocabulary is a
    400 on every turn, so a run that ignored the profile measured nothing."""
    if args.vocab is not None:
        if args.vocab < 2:
            raise ValueError(f"--vocab must be >= 2, got {args.vocab}")
        return args.vocab
    if sc.vocab is not None:
        return sc.vocab
    if not args.engine:
        from kvgate.tools.sim import load_profile

        return min(VOCAB_DEFAULT, load_profile(args.profile or sc.profile).vocab_size)
    return VOCAB_DEFAULT


def build_workload(args: argparse.Namespace, sc: Scenario) -> Workload:
    vocab = workload_vocab(args, sc)
    if args.trace:
        return load_trace(args.trace, seed=args.seed, vocab=vocab)
    tool = ToolLatency(
        fast_median_s=args.tool_fast_median if args.tool_fast_median is not None else sc.tool.fast_median_s,
        slow_median_s=args.tool_slow_median if args.tool_slow_median is not None else sc.tool.slow_median_s,
        slow_frac=args.tool_slow_frac if args.tool_slow_frac is not None else sc.tool.slow_frac,
        sigma=args.tool_sigma if args.tool_sigma is not None else sc.tool.sigma,
        max_s=args.tool_max if args.tool_max is not None else sc.tool.max_s)
    spec = WorkloadSpec(
        sessions=args.sessions if args.sessions is not None else sc.sessions,
        turns=parse_range(args.turns or sc.turns, name="--turns", minimum=1),
        first_prompt=parse_range(args.first_prompt or sc.first_prompt, name="--first-prompt", minimum=1),
        tool_result=parse_range(args.tool_result or sc.tool_result, name="--tool-result"),
        output=parse_range(args.output or sc.output, name="--output", minimum=1),
        tool=tool,
        arrival_spread_s=args.arrival_spread if args.arrival_spread is not None else sc.arrival_spread_s,
        vocab=vocab)
    return generate(spec, seed=args.seed)


class SimEnv(EngineEnv):
    """A fresh simulated SGLang cluster per policy (``kvgate.tools.sim.SimCluster``).

    The simulator runs in a child process (the bench, its poller and Redis share the
    other core).  Turns go straight to the engines; with several engines the bench places
    each session on one engine by a hash of its id (sticky, what a cache-aware router
    converges to), so the simulator's router is not started.
    """

    def __init__(self, profile: str, engines: int, time_scale: float, kv_capacity: int | None,
                 in_process: bool = False, prefill_metrics: bool = False) -> None:
        from kvgate.tools.sim import load_profile

        base = load_profile(profile)
        if kv_capacity is not None and (isinstance(kv_capacity, bool) or not isinstance(kv_capacity, int)
                                        or kv_capacity < base.block_size):
            raise ValueError(f"--kv-capacity must hold at least one block of profile {base.name} "
                             f"({base.block_size} tokens), got {kv_capacity!r}")
        self.profile = load_profile(profile, kv_capacity_tokens=kv_capacity) if kv_capacity is not None else base
        self.engines = engines
        self.time_scale = time_scale
        self.in_process = in_process
        self.prefill_metrics = prefill_metrics

    def describe(self) -> dict:
        return {"engine": "sglang-simulator (kvgate.tools.sim)", "profile": self.profile.name,
                "engines": self.engines, "kv_capacity_tokens": self.profile.kv_capacity_tokens,
                "pool_tokens": self.pool_tokens, "time_scale": self.time_scale,
                "profile_source": self.profile.source, "prefill_metrics": self.prefill_metrics}

    @property
    def pool_tokens(self) -> int:
        return self.profile.kv_capacity_tokens * self.engines

    @property
    def block_size(self) -> int:
        """The profile's KV block (page) size: re-prefill counts whole blocks only."""
        return self.profile.block_size

    def request_limit(self) -> tuple[int, str]:
        """The most tokens (prompt + output) one request may hold on a simulated engine, and
        why: its context length, or its KV pool less one block (kvgate.tools.sim.engine.validate)."""
        p = self.profile
        pool = (p.kv_capacity_tokens // p.block_size) * p.block_size
        if p.max_context <= pool - p.block_size:
            return p.max_context, f"profile {p.name}'s context length"
        return pool - p.block_size, f"profile {p.name}'s KV pool ({pool:,} tokens, less one block of {p.block_size})"

    @contextlib.asynccontextmanager
    async def fresh(self) -> AsyncIterator[EngineClient]:
        from kvgate.tools.sim import SimCluster

        cluster = SimCluster(self.engines, self.profile, time_scale=self.time_scale, router=False,
                             process=not self.in_process, health_check_interval_s=None,
                             prefill_metrics=self.prefill_metrics)
        starting = asyncio.ensure_future(asyncio.to_thread(cluster.start))
        try:
            await asyncio.shield(starting)
        except BaseException:
            # interrupted (Ctrl-C, SIGTERM) while the simulator starts: let the start finish
            # (it is bounded) and stop what it started, or its process outlives the bench
            with contextlib.suppress(BaseException):
                await starting
            await asyncio.to_thread(cluster.stop)
            raise
        client = None
        try:
            client = make_client("sglang", cluster.engine_urls, cluster.engine_urls, lean=True)
            yield client
        finally:
            if client is not None:
                await client.aclose()
            await asyncio.to_thread(cluster.stop)


class RealEnv(EngineEnv):
    """Real engines: prefix caches reset between policies (vLLM needs VLLM_SERVER_DEV_MODE=1)."""

    def __init__(self, kind: str, urls: Sequence[str], router: str | None, model: str | None) -> None:
        self.kind, self.urls, self.router, self.model = kind, list(urls), router, model
        self.pool_tokens: int | None = None
        self.engine_tokens: int | None = None  # the smallest engine's pool (/kvgate/usage)
        self.max_model_len: int | None = None  # vLLM's /v1/models says it
        self.block_size: int | None = None  # the engines' KV block, when /kvgate/usage gives one size
        self.reset_ok: list[bool] = []

    def describe(self) -> dict:
        return {"engine": self.kind, "urls": self.urls, "router": self.router,
                "pool_tokens": self.pool_tokens, "prefix_cache_reset": self.reset_ok}

    def _client(self) -> EngineClient:
        gen = [self.router] if self.router else self.urls
        kw = {"model": self.model} if self.kind == "vllm" else {}
        return make_client(self.kind, gen, self.urls, **kw)

    async def probe_pool(self, timeout_s: float = 5.0) -> int | None:
        """Check that every engine (and the router) answers ``GET /health`` with 2xx, read
        vLLM's ``max_model_len`` from ``/v1/models`` and the pool from ``/kvgate/usage`` (an
        engine without that route, as a real SGLang, leaves the pool unknown). ValueError
        when an engine does not answer or answers as no engine would; every call is bounded
        by ``timeout_s``."""
        import httpx

        c = self._client()
        try:
            async def health(u: str) -> str | None:
                try:
                    r = await c.http.get(u + "/health", timeout=timeout_s)
                except (httpx.HTTPError, httpx.InvalidURL, OSError, ValueError) as e:
                    return f"{u}: no answer to GET /health ({type(e).__name__}{': ' + str(e) if str(e) else ''})"
                if not 200 <= r.status_code < 300:
                    return f"{u}: GET /health answered HTTP {r.status_code} (is it the engine's base URL?)"
                return None

            targets = self.urls + ([self.router.rstrip("/")] if self.router else [])
            problems = [p for p in await asyncio.gather(*(health(u.rstrip("/")) for u in targets)) if p]
            if problems:
                raise ValueError("--engine: " + "; ".join(problems))
            if self.kind == "vllm":
                await self._read_model(c, timeout_s)
            us = await c.usage()
        finally:
            await c.aclose()
        caps = [u["capacity_tokens"] for u in us if u["healthy"]]
        self.pool_tokens = sum(caps) if caps else None
        self.engine_tokens = min(caps) if caps else None
        blocks = {u.get("block_size") for u in us if u["healthy"]}
        # re-prefill counts whole blocks only where every engine has the same, known block size
        self.block_size = blocks.pop() if len(blocks) == 1 and None not in blocks else None
        return self.pool_tokens

    async def _read_model(self, c: EngineClient, timeout_s: float) -> None:
        """The served model (``--model``, else the first) and its ``max_model_len``."""
        import httpx

        u = c.generate_urls[0]
        try:
            r = await c.http.get(u + "/v1/models", timeout=timeout_s)
            r.raise_for_status()
            data = r.json()["data"]
            ids = [m["id"] for m in data]
        except (httpx.HTTPError, ValueError, KeyError, TypeError, IndexError) as e:
            raise ValueError(f"--engine: {u}: GET /v1/models gave no model list ({type(e).__name__}: {e}); "
                             f"is it a vLLM server (--engine-kind)?") from None
        if not ids:
            raise ValueError(f"--engine: {u}: serves no model (GET /v1/models)")
        if self.model is not None and self.model not in ids:
            raise ValueError(f"--model {self.model}: not served by {u} (it serves {', '.join(map(str, ids))})")
        entry = data[ids.index(self.model)] if self.model is not None else data[0]
        mml = entry.get("max_model_len") if isinstance(entry, dict) else None
        if isinstance(mml, int) and not isinstance(mml, bool) and mml > 0:
            self.max_model_len = mml

    def request_limit(self) -> tuple[int, str] | None:
        """What the engines said bounds one request (vLLM's max_model_len, the smallest
        engine's KV pool), or None where they said nothing."""
        limits = []
        if self.max_model_len is not None:
            limits.append((self.max_model_len, "the engine's max_model_len (/v1/models)"))
        if self.engine_tokens is not None:
            limits.append((self.engine_tokens, "the smallest engine's KV pool (/kvgate/usage)"))
        return min(limits) if limits else None

    @contextlib.asynccontextmanager
    async def fresh(self) -> AsyncIterator[EngineClient]:
        client = self._client()
        # Wait (bounded) until the engines are idle, then reset their prefix caches.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            us = await client.usage()
            if all((u["usage"] or 0.0) == 0.0 for u in us):
                break
            await asyncio.sleep(0.5)
        ok = await client.reset_prefix_cache()
        self.reset_ok.append(ok)
        if not ok:
            import warnings

            warnings.warn(f"could not flush the prefix cache of {self.urls} (vLLM needs VLLM_SERVER_DEV_MODE=1); "
                          "policies after the first start warm", RuntimeWarning, stacklevel=2)
        try:
            yield client
        finally:
            await client.aclose()


async def _maybe_async(x: Any) -> Any:
    import inspect

    return await x if inspect.isawaitable(x) else x


def default_caps(workload: Workload, pool_tokens: int | None) -> list[int]:
    """One, one and a half (rounded half up) and two times the number of sessions whose final
    contexts fit in the pool ("fit"), clipped to [1, sessions] and deduplicated; where the
    pool is unknown, a quarter of the sessions stands in for fit.

    The best cap often lies between fit and twice fit (cap-20 of a 12..36 sweep on the
    default scenario, cap-3 on cpu-heavy), so the sweep has a point there. Half of fit was in
    the sweep until it had lost every run we made (too few sessions: the engine idles while
    they wait on tools) while being the longest policy of the run. ``--caps`` sweeps anything."""
    n = len(workload.sessions)
    if pool_tokens:
        mean_final = workload.working_set_tokens() / max(1, n)
        fit = max(1, int(pool_tokens / max(1.0, mean_final)))
    else:
        fit = max(1, n // 4)
    return sorted({max(1, min(n, c)) for c in (fit, (3 * fit + 1) // 2, 2 * fit)})


def _parse_caps(text: str) -> list[int]:
    try:
        caps = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--caps expects integers separated by commas, got {text!r}") from None
    if not caps or any(c < 1 for c in caps):
        raise ValueError(f"--caps needs integers >= 1, got {text!r}")
    return sorted(set(caps))


async def _run_all(args: argparse.Namespace, sc: Scenario, workload: Workload, env: EngineEnv,
                   policies: list[Policy], redis_url: str, base_cfg: Any, time_scale: float,
                   console: Any) -> list[list]:
    """Every policy once per round, in order, rounds one after another: a list per round."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    rounds: list[list] = []
    total = workload.num_turns * args.rounds
    progress = Progress(TextColumn("{task.description:<14}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("turns"), TimeElapsedColumn(), TextColumn("{task.fields[info]}"),
                        console=console, disable=args.no_progress, transient=False)
    with progress:
        tasks = {p.name: progress.add_task(escape(p.name), total=total, info="", start=False) for p in policies}
        walls: dict[str, list[str]] = {p.name: [] for p in policies}
        for _ in range(args.rounds):
            results = []
            for p in policies:
                tid = tasks[p.name]
                progress.start_task(tid)

                def on_turn(rec, tid=tid):
                    progress.advance(tid)

                async with env.fresh() as client:
                    res = await run_policy(p, workload, client, time_scale=time_scale, redis_url=redis_url,
                                           base_cfg=base_cfg, scale_knobs=not args.no_scale_knobs,
                                           snapshot_interval_s=args.snapshot_interval, on_turn=on_turn,
                                           step_timeout_s=getattr(args, "step_timeout", None))
                hr = res.counters.hit_rate
                walls[p.name].append(f"{res.wall_s:.2f}s")
                progress.update(tid, info=" ".join(walls[p.name]) + (f"  hit {hr:.3f}" if hr is not None else ""))
                progress.stop_task(tid)
                results.append(res)
            rounds.append(results)
    return rounds


class Terminated(KeyboardInterrupt):
    """SIGTERM during a bench run. A subclass, not ``KeyboardInterrupt`` itself: CPython
    remembers an exact ``KeyboardInterrupt`` that escapes any ``exec`` of a string (dataclass
    and namedtuple creation run one) and, under ``python -m``, then ends the process with
    SIGINT at exit even though the bench caught it and returned 130 (seen in CI as exit -2).
    The check is on the exact type, so a subclass keeps the exit code ours."""


@contextlib.contextmanager
def _sigterm_interrupts():
    """SIGTERM raises Terminated (a KeyboardInterrupt) while the bench runs (main thread only), so the
    simulator's child process and the embedded redis-server are stopped by the same
    clean-up as Ctrl-C instead of being orphaned by a ``kill``."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _raise(signum, frame):
        raise Terminated(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


MAX_TIME_SCALE = 100.0
MAX_SNAPSHOT_INTERVAL_S = 60.0
#: the bound on each check of an engine or Redis before the run (per call, s)
PROBE_TIMEOUT_S = 5.0
# the files a run writes into --out (report.write_json, report.write_plots)
_OUT_FILES = ("bench.json",)
_PLOT_FILES = ("hit_rate_over_time.png", "latency_by_turn.png")


def _flag(dest: str) -> str:
    """The command-line flag of argparse destination ``dest``."""
    return "--" + dest.replace("_", "-")


def _check_flag_combinations(args: argparse.Namespace) -> None:
    """Flags a run would ignore are errors, not silently dropped."""
    if args.trace:
        given = [_flag(dest) for dest, _ in WORKLOAD_FLAGS if getattr(args, dest, None) is not None]
        if given:
            raise ValueError(f"{', '.join(given)} cannot be used with --trace: the trace's lines give its "
                             f"sessions, turns, token counts and gaps")
    if args.engine:
        given = [_flag(dest) for dest, _ in SIM_FLAGS if getattr(args, dest) is not None]
        if args.sim_prefill_metrics:
            given.append("--sim-prefill-metrics")
        if given:
            raise ValueError(f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to the simulator, "
                             f"not to --engine URLs")
    else:
        given = [flag for flag, dest in (("--router", "router"), ("--model", "model"))
                 if getattr(args, dest) is not None]
        if given:
            raise ValueError(f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to --engine URLs, "
                             f"not to the simulator")


def _check_http_url(flag: str, url: str) -> None:
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


def _prepare(args: argparse.Namespace, probe: bool) -> tuple:
    """Check every argument and build what a run needs. Everything that needs no engine and
    no Redis is checked first; ``probe=False`` stops there (the pool of real engines is then
    unknown, so default caps are a placeholder). ``probe=True`` then asks the engines (they
    must answer; what they say bounds the workload), pings ``--redis`` when a gate policy
    will use it, and creates ``--out``. Raises ValueError; nothing has run by then."""
    sc = SCENARIOS[args.scenario]
    if isinstance(args.rounds, bool) or not isinstance(args.rounds, int) or args.rounds < 1:
        raise ValueError(f"--rounds must be an integer >= 1, got {args.rounds!r}")
    time_scale = args.time_scale if args.time_scale is not None else (1.0 if args.engine else sc.time_scale)
    if not (math.isfinite(time_scale) and 0 < time_scale <= MAX_TIME_SCALE):
        raise ValueError(f"--time-scale must be a number in (0, {MAX_TIME_SCALE:g}], got {time_scale}")
    if args.snapshot_interval is None:
        args.snapshot_interval = min(MAX_SNAPSHOT_INTERVAL_S, max(0.05, 1.0 * time_scale))
    if not (math.isfinite(args.snapshot_interval) and 0 < args.snapshot_interval <= MAX_SNAPSHOT_INTERVAL_S):
        raise ValueError(f"--snapshot-interval must be a number of seconds in (0, {MAX_SNAPSHOT_INTERVAL_S:g}], "
                         f"got {args.snapshot_interval}")
    step_timeout = getattr(args, "step_timeout", None)
    if step_timeout is not None and not (math.isfinite(step_timeout) and step_timeout > 0):
        raise ValueError(f"--step-timeout must be a finite number of seconds > 0, got {step_timeout}")
    if (getattr(args, "embedded_redis", "auto") == "redis-server" and not args.redis
            and shutil.which("redis-server") is None):
        raise ValueError("--embedded-redis redis-server: no redis-server binary on PATH "
                         "(install it, or use --embedded-redis fakeredis or --redis URL)")
    if args.redis:
        check_redis_url(args.redis)
    check_out_dir(args.out, plots=not args.no_plots)
    _check_flag_combinations(args)
    workload = build_workload(args, sc)
    check_fits(workload, MAX_REQUEST_TOKENS, "the bench")
    env: EngineEnv | None = None
    pool = None
    if args.engine:
        for flag, urls in (("--engine", args.engine), ("--router", [args.router] if args.router else [])):
            for u in urls:
                _check_http_url(flag, u)
        make_client(args.engine_kind, args.engine, args.engine)  # validates the URLs
    else:
        engines = args.sim_engines if args.sim_engines is not None else sc.engines
        if engines < 1:
            raise ValueError("--sim-engines must be >= 1")
        env = SimEnv(args.profile or sc.profile, engines, time_scale,
                     args.kv_capacity if args.kv_capacity is not None else sc.kv_capacity,
                     prefill_metrics=args.sim_prefill_metrics)
        check_sim_fits(workload, env, vocab_given=args.vocab is not None)
        pool = env.pool_tokens
    caps = _parse_caps(args.caps) if args.caps else default_caps(workload, pool)
    if args.policies is None:
        args.policies = default_policies(sc, trace=bool(args.trace))
    policies = parse_policies(args.policies, caps)
    base_cfg = base_gate_config(args)  # validated even when no gate policy runs: bad flags are errors
    for p in policies:  # a policy's own knobs are checked now, not when its turn comes
        if p.kind == "gate":
            cfg = scaled_gate_config(base_cfg, p, time_scale)
            # the poller refuses an interval at or past the staleness bound (every snapshot
            # would read stale before the next one and every turn would bypass as degraded)
            if args.snapshot_interval >= cfg.staleness_s:
                raise ValueError(f"--snapshot-interval ({args.snapshot_interval:g} s) must be below the "
                                 f"staleness_s of policy {p.name} ({cfg.staleness_s:g} s)")
    if probe:
        if args.engine:
            env = RealEnv(args.engine_kind, args.engine, args.router, args.model)
            pool = asyncio.run(env.probe_pool(PROBE_TIMEOUT_S))
            limit = env.request_limit()
            if limit is not None:
                check_fits(workload, *limit)
            if not args.caps:
                caps = default_caps(workload, pool)
                policies = parse_policies(args.policies, caps)
        if args.redis and any(p.kind == "gate" for p in policies):
            ping_redis(args.redis)
        make_out_dir(args.out)
    return sc, time_scale, workload, env, pool, caps, policies, base_cfg


def check_args(argv: Sequence[str]) -> str | None:
    """Check ``kvgate bench`` arguments without starting or probing any engine or Redis: the
    error a run would stop on, or None. For wrappers that start engines first
    (benchmarks/real_vllm.py), so a typo costs no server start. argparse errors exit 2."""
    args = build_parser().parse_args(list(argv))
    try:
        _prepare(args, probe=False)
    except ValueError as e:
        return str(e)
    return None


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console(stderr=False, width=None if sys.stdout.isatty() else 200)
    if getattr(args, "list_scenarios", False):
        for name, sc in SCENARIOS.items():
            console.print(f"[bold]{name}[/]: {sc.description} (profile {sc.profile}, {sc.sessions} sessions, "
                          f"turns {sc.turns}, time scale {sc.time_scale}"
                          + (f"; step-sized knobs {sc.step_knobs}" if sc.step_knobs else "") + ")")
        return 0
    try:
        sc, time_scale, workload, env, pool, caps, policies, base_cfg = _prepare(args, probe=True)
    except ValueError as e:
        console.print(f"[red]error:[/] {escape(str(e))}")
        return 2

    out_dir = Path(args.out)
    wl = workload.describe()
    pool_text = f"{pool:,} tokens" if pool else "unknown (no /kvgate/usage)"
    console.print(f"[bold]kvgate bench[/] scenario [cyan]{args.scenario}[/]: {wl['sessions']} sessions, "
                  f"{wl['turns']} turns, working set {wl['working_set_tokens']:,} tokens vs pool {pool_text}",
                  highlight=False)
    console.print(f"tool latency p50 {wl['tool_latency_p50_s']}s p90 {wl['tool_latency_p90_s']}s (unscaled), "
                  f"time scale {time_scale}; policies: {escape(', '.join(p.name for p in policies))}", highlight=False)
    host = describe_host()  # before the run: its load average is the machine's, not ours
    console.print(escape(host_line(host)), highlight=False)

    t_start = time.monotonic()
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_sigterm_interrupts())
            if any(p.kind == "gate" for p in policies):
                if args.redis:
                    redis_url, redis_kind = args.redis, "external"
                else:
                    from .redis_embed import embedded_redis

                    redis_url, redis_kind = stack.enter_context(embedded_redis(args.embedded_redis))
            else:
                redis_url, redis_kind = None, "unused"
            rounds = asyncio.run(_run_all(args, sc, workload, env, policies, redis_url, base_cfg,
                                          time_scale, console))
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the simulator and Redis were stopped on the way out
        console.print("[red]interrupted[/]: no results written")
        return 130
    except (RuntimeError, OSError, TimeoutError, RedisError) as e:
        # a part that would not start (redis-server, the simulator), a Redis lost after it
        # answered the check, or a step past its timeout: what was started is stopped on the
        # way out; say why, not a traceback
        console.print(f"[red]error:[/] {escape(f'{type(e).__name__}: {e}')}: no results written",
                      highlight=False)
        return 1
    elapsed = time.monotonic() - t_start

    # the engines' block size, where the bench knows it (the simulator's profile; a real
    # engine's when its env records one): re-prefill then leaves out the partial blocks
    block = getattr(env, "block_size", None)
    summaries = [summarize(results, workload, block_size=block) for results in rounds]
    summary = combine_rounds(summaries)
    render_table(summary, console, scenario=f"trace {args.trace}" if args.trace else args.scenario)
    # the issue-5 checks: the simulator scenarios, and the CPU vLLM ones (on real engines or
    # on the simulator's profile fitted to them); never for a trace, whose regime is unknown
    check_kind = {"default": "pressure", "long-context": "pressure", "no-pressure": "no-pressure",
                  "cpu-heavy": "cpu-heavy", "cpu-tiny": "cpu-tiny"}.get(args.scenario)
    if args.engine and check_kind in ("pressure", "no-pressure"):
        check_kind = None  # those targets are about the simulator's GPU profile
    verdicts = checks(summary, check_kind) if check_kind and not args.trace else []
    # the targets are defined on the unmodified scenario: say which flags changed it
    from .report import scenario_changes

    changed = scenario_changes(args, sc, time_scale=time_scale, caps_run=[p.cap for p in policies if p.kind == "cap"],
                               default_caps=default_caps(workload, pool)) \
        if any(ok is not None for _, ok, _ in verdicts) else []
    if changed:
        console.print(f"[yellow]modified scenario[/] ({escape(', '.join(changed))}): the checks below are made on "
                      f"it, but the issue's targets are defined on the unmodified {escape(args.scenario)} scenario",
                      highlight=False)
    for name, ok, detail in verdicts:
        mark = "[yellow]NOT MADE[/]" if ok is None else "[green]PASS[/]" if ok else "[red]FAIL[/]"
        note = " [yellow](modified scenario)[/]" if changed and ok is not None else ""
        console.print(f"{mark} {escape(name)}: {escape(detail)}{note}", highlight=False)  # kvgate[..] is markup
    lagged = round_lag_warnings(summaries, time_scale)
    for line in lagged:
        console.print(f"[yellow]warning:[/] {escape(line)}", highlight=False)
    extra = {"scenario": args.scenario, "time_scale": time_scale, "engines": env.describe(),
             "redis": redis_kind, "elapsed_s": elapsed, "caps": caps, "rounds": args.rounds,
             "checks": [{"check": n, "passed": ok, "detail": d, "made": ok is not None,
                         "modified_scenario": bool(changed)} for n, ok, d in verdicts],
             "scenario_modified_by": changed,
             "warnings": lagged,
             "argv": sys.argv[1:], "version": _source_version(), "host": host}
    json_path = out_dir / "bench.json"
    write_json(summary, json_path, extra)
    paths = [json_path]
    if not args.no_plots:
        paths += write_plots(summary, out_dir)
    console.print(f"total {elapsed:.1f}s; wrote {', '.join(str(p) for p in paths)}", highlight=False)
    errors = sum(r.errors for results in rounds for r in results)
    if errors:  # a run that lost turns measured less than the workload: say so, exit non-zero
        console.print(f"[red]error:[/] {errors} turn(s) failed; first: "
                      f"{escape(next(e for results in rounds for r in results for e in r.error_examples))}",
                      highlight=False)
        return 1
    return 0


def _source_version() -> dict:
    """The kvgate version and, for a source checkout, its git commit and whether the gate's
    code (kvgate/, lua/) had uncommitted changes: results belong to one gate version."""
    import subprocess

    import kvgate

    out: dict = {"kvgate": getattr(kvgate, "__version__", "?")}
    root = Path(kvgate.__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=5)
        if head.returncode == 0:
            out["git_commit"] = head.stdout.strip()
            st = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "kvgate", "lua"],
                                capture_output=True, text=True, timeout=5)
            out["gate_code_modified"] = sorted({ln[3:] for ln in st.stdout.splitlines()
                                                if ln[:2].strip() and not ln.startswith("??")
                                                and not ln[3:].startswith("kvgate/tools/bench")})
    except (OSError, subprocess.SubprocessError):
        pass
    return out


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))
