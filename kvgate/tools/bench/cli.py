"""``kvgate bench``: run one seeded agentic workload through several policies, side by side;
with ``--matrix``, every scenario, in one table.

``add_arguments(parser)`` and ``run(args) -> int`` are called by ``kvgate/cli.py``;
``python -m kvgate.tools.bench`` calls :func:`main`. ``check_args`` checks arguments without
touching an engine (for wrappers that start engines first). Exit codes: 0; 1 when a part
would not start, a step timed out or turns failed; 2 for bad arguments, before anything
runs; 130 when interrupted.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

from redis.exceptions import RedisError

from .flags import add_arguments, build_parser
from .preflight import Plan, prepare

__all__ = ["add_arguments", "build_parser", "run", "main", "check_args"]

#: where the run's own log lines (the poller's leader changes, the client's warnings) go,
#: in --out: the console keeps the table
LOG_FILE = "bench.log"


def check_args(argv: Sequence[str]) -> str | None:
    """Check ``kvgate bench`` arguments without starting or probing any engine or Redis: the
    error a run would stop on, or None. For wrappers that start engines first
    (benchmarks/real_vllm.py), so a typo costs no server start. argparse errors exit 2."""
    args = build_parser().parse_args(list(argv))
    try:
        prepare(args, probe=False)
    except ValueError as e:
        return str(e)
    return None


def run(args: argparse.Namespace) -> int:
    from kvgate.tools import BENCH_INSTALL, missing_bench_modules

    missing = missing_bench_modules()
    if missing:  # the runtime install: the bench needs its extra
        print(f"kvgate bench: needs the bench extra ({', '.join(missing)} missing): {BENCH_INSTALL}",
              file=sys.stderr)
        return 2
    from rich.console import Console
    from rich.markup import escape

    console = Console(stderr=False, width=None if sys.stdout.isatty() else 200)
    if getattr(args, "list_scenarios", False):
        _list_scenarios(console)
        return 0
    try:
        plans = prepare(args, probe=True)
    except ValueError as e:
        console.print(f"[red]error:[/] {escape(str(e))}")
        return 2

    from .host import describe as describe_host
    from .host import summary_line as host_line

    host = describe_host()  # before the run: its load average is the machine's, not ours
    console.print(escape(host_line(host)), highlight=False)
    out_dir = Path(args.out)
    t_start = time.monotonic()
    try:
        with contextlib.ExitStack() as stack:
            from .signals import sigterm_interrupts

            stack.enter_context(sigterm_interrupts())
            stack.enter_context(_logs_to(out_dir / LOG_FILE))
            redis_url, redis_kind = _redis_for(plans, args, stack)
            outcomes = [_run_plan(plan, args, redis_url, console) for plan in plans]
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
    context = {"redis": redis_kind, "rounds": args.rounds, "argv": sys.argv[1:], "version": _source_version(),
               "host": host, "log": str(out_dir / LOG_FILE)}
    paths = _report_matrix(outcomes, args, context, console) if args.matrix else \
        _report_one(outcomes[0], args, context, console)
    console.print(f"total {time.monotonic() - t_start:.1f}s; wrote {', '.join(str(p) for p in paths)}",
                  highlight=False)
    failed = [o for o in outcomes if o.errors]
    for o in failed:  # a run that lost turns measured less than the workload: say so, exit non-zero
        console.print(f"[red]error:[/] {escape(o.plan.name)}: {o.errors} turn(s) failed; first: "
                      f"{escape(o.first_error)}", highlight=False)
    return 1 if failed else 0


def _run_plan(plan: Plan, args: argparse.Namespace, redis_url: str | None, console: Any) -> Any:
    """Print what is about to run, run it, and evaluate it."""
    from rich.markup import escape

    from .outcome import evaluate
    from .rounds import run_rounds

    wl = plan.workload.describe()
    pool_text = f"{plan.pool:,} tokens" if plan.pool else "unknown (no /kvgate/usage)"
    console.print(f"[bold]kvgate bench[/] scenario [cyan]{escape(plan.name)}[/]: {wl['sessions']} sessions, "
                  f"{wl['turns']} turns, working set {wl['working_set_tokens']:,} tokens vs pool {pool_text}",
                  highlight=False)
    console.print(f"tool latency p50 {wl['tool_latency_p50_s']}s p90 {wl['tool_latency_p90_s']}s (unscaled), "
                  f"time scale {plan.time_scale}; policies: {escape(', '.join(p.name for p in plan.policies))}"
                  + (" (the cap sweep widens while its best cap is at its edge)" if plan.sweep.widen and plan.sweep.caps
                     else ""),
                  highlight=False)
    t0 = time.monotonic()
    rounds = asyncio.run(run_rounds(plan, args, redis_url, console))
    return evaluate(plan, rounds, args, elapsed_s=time.monotonic() - t0)


def _report_one(o: Any, args: argparse.Namespace, context: dict, console: Any) -> list[Path]:
    """One scenario: the full table, the verdicts, bench.json and the plots."""
    from rich.markup import escape

    from .outcome import outcome_record, print_verdicts
    from .plots import write_plots
    from .summary import write_json
    from .table import render_table

    render_table(o.summary, console, scenario=f"trace {args.trace}" if args.trace else o.plan.name)
    if getattr(args, "steps", 1) > 1:
        console.print(f"{args.steps} rollout steps per policy on one gate; the table is the last step's. "
                      "Each step's wall-clock (s):", highlight=False)
        for row in o.summary["policies"]:
            console.print(f"  {escape(row['policy'])}: " + " ".join(f"{w:.2f}" for w in row["step_walls"]),
                          highlight=False)
    print_verdicts(o, console)
    path = Path(args.out) / "bench.json"
    write_json(o.summary, path, {**outcome_record(o), **context})
    return [path] + ([] if args.no_plots else write_plots(o.summary, Path(args.out)))


def _report_matrix(outcomes: Sequence[Any], args: argparse.Namespace, context: dict, console: Any) -> list[Path]:
    """Every scenario: one table, each scenario's verdicts under it, one bench.json."""
    from .matrix import matrix_document, matrix_row, render_matrix
    from .outcome import print_verdicts
    from .summary import write_json

    rows = [matrix_row(o) for o in outcomes]
    render_matrix(rows, console, args.rounds)
    for o in outcomes:
        print_verdicts(o, console, prefix=f"{o.plan.name}: ")
    path = Path(args.out) / "bench.json"
    write_json(matrix_document(outcomes, rows, context), path)
    return [path]


def _redis_for(plans: Sequence[Plan], args: argparse.Namespace, stack: contextlib.ExitStack) -> tuple:
    """The Redis the gate policies use, (url, kind): ``--redis``, else a private one for the
    whole run (stopped by ``stack``); none when no gate policy runs."""
    if not any(p.kind == "gate" for plan in plans for p in plan.policies):
        return None, "unused"
    if args.redis:
        return args.redis, "external"
    from .redis_embed import embedded_redis

    return stack.enter_context(embedded_redis(args.embedded_redis))


@contextlib.contextmanager
def _logs_to(path: Path) -> Iterator[None]:
    """Send kvgate's log records (the poller's INFO lines, the client's warnings) to ``path``
    for the run, not to the console, where they would break up the progress and the table."""
    log = logging.getLogger("kvgate")
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    saved = log.level, log.propagate
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        yield
    finally:
        log.removeHandler(handler)
        handler.close()
        log.setLevel(saved[0])
        log.propagate = saved[1]


def _list_scenarios(console: Any) -> None:
    from rich.markup import escape

    from .scenarios import SCENARIOS

    for name, sc in SCENARIOS.items():
        console.print(f"[bold]{escape(name)}[/]: {escape(sc.description)} (profile {sc.profile}, {sc.sessions} "
                      f"sessions, turns {sc.turns}, time scale {sc.time_scale}"
                      + (f", arrivals over {sc.arrival_spread_s:g} s" if sc.arrival_spread_s else "") + ")",
                      highlight=False)


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
                                                and not ln[3:].startswith("kvgate/tools/")})
    except (OSError, subprocess.SubprocessError):
        pass
    return out


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))
