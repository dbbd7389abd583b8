"""The flags of ``kvgate bench``, and what they changed in the named scenario of a run."""
from __future__ import annotations

import argparse
from typing import Any, Sequence

from kvgate.knob_flags import add_knob_arguments

from .scenarios import SCENARIOS
from .workload import parse_range

__all__ = ["add_arguments", "build_parser", "DESCRIPTION", "DEFAULT_POLICIES", "MATRIX_POLICIES", "matrix_policies",
           "WORKLOAD_FLAGS",
           "SIM_FLAGS", "flag_name", "scenario_changes"]

DESCRIPTION = "run one seeded agentic workload through several policies, side by side"
#: the policies of a run without --policies: every kind once
DEFAULT_POLICIES = "none,cap,admission,residency,kvgate"
#: the policies of every scenario of --matrix: what the targets compare (docs/benchmarks.md#checks)
MATRIX_POLICIES = "none,cap,kvgate"


def matrix_policies(sc: Any) -> str:
    """The policies --matrix runs on scenario ``sc``: :data:`MATRIX_POLICIES`, and where its
    sessions share prefixes the full gate told nothing of them, which sharing is judged against."""
    from .policies import NOSHARE_GATE

    shares = sc.group_size > 1 or sc.system_prompt > 0
    return MATRIX_POLICIES + (f",{NOSHARE_GATE}" if shares else "")


class _StoreGiven(argparse.Action):
    """Store the value and note that the flag was given (``<dest>_given``): --matrix refuses a
    --scenario it would ignore, even one naming the default."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        setattr(namespace, self.dest + "_given", True)


def flag_name(dest: str) -> str:
    """The command-line flag of argparse destination ``dest``."""
    return "--" + dest.replace("_", "-")


def add_arguments(p: argparse.ArgumentParser) -> None:
    sc = p.add_argument_group("scenario and workload")
    sc.add_argument("--scenario", choices=sorted(SCENARIOS), default="default", action=_StoreGiven,
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
    sc.add_argument("--group-size", type=int, help="samples per task (GRPO's n): each run of this many "
                    "sessions sends one first prompt, then diverges; 1: no groups")
    sc.add_argument("--system-prompt", type=int, help="leading tokens of every first prompt that are one "
                    "system prompt, shared by all sessions")
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
                     help="comma list of none, cap (the cap sweep), cap-N, turncap-N, admission, residency, "
                          "kvgate; a gate policy may set knobs of its own, e.g. 'kvgate[max_wait_s=600]', and "
                          "with -noshare (kvgate-noshare) its turns do not say which prefixes they share "
                          f"(default: {DEFAULT_POLICIES}; with --matrix always {MATRIX_POLICIES})")
    pol.add_argument("--caps", help="caps to sweep for 'cap', e.g. 4,8,16 (default: derived from the pool: "
                                    "one, one and a half and two times the sessions whose final context fits, "
                                    "widened while the best cap is at the sweep's edge; given caps do not widen)")
    pol.add_argument("--matrix", action="store_true",
                     help=f"run every named scenario (or --scenarios) with {MATRIX_POLICIES} and print one "
                          "table: per scenario kvgate against no gate and the best fixed cap")
    pol.add_argument("--scenarios", metavar="A,B,...",
                     help="with --matrix: the scenarios to run, in this order (default: all)")
    pol.add_argument("--steps", type=int, default=1,
                     help="run this many rollout steps back to back per policy, as a trainer does: one "
                          "gate throughout (what its budget learned carries over), the engines' caches "
                          "reset and new sessions each step; every figure is the last step's, and "
                          "bench.json lists each step's wall-clock (default: %(default)s)")
    pol.add_argument("--rounds", type=int, default=1,
                     help="run every policy this many times, interleaved (round 1 runs each policy once, "
                          "then round 2, ...), and report each policy's median; the checks read the "
                          "medians of the per-round ratios (default: %(default)s)")

    eng = p.add_argument_group("engines")
    eng.add_argument("--profile", help="simulator profile name or JSON path")
    eng.add_argument("--sim-engines", type=int, help="simulated engines behind the router")
    eng.add_argument("--kv-capacity", type=int, help="override the profile's KV pool per engine (tokens)")
    eng.add_argument("--sim-prefill-metrics", action=argparse.BooleanOptionalAction, default=None,
                     help="the simulator exports its prefill time, as vLLM does (default: on; SGLang "
                          "does not, and without it the gate's budget falls back: docs/budget.md)")
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

    add_knob_arguments(p)
    p.add_argument("--knob", action="append", default=[], metavar="NAME=VALUE",
                   help="set a GateConfig knob for the gate policies (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvgate bench", description=DESCRIPTION)
    add_arguments(p)
    return p


#: ``kvgate bench`` flags that set the workload (argparse dest, the scenario's attribute); an
#: attribute ``tool.x`` is the scenario's tool latency's ``x``
WORKLOAD_FLAGS = (("sessions", "sessions"), ("turns", "turns"), ("first_prompt", "first_prompt"),
                   ("tool_result", "tool_result"), ("output", "output"),
                   ("tool_fast_median", "tool.fast_median_s"), ("tool_slow_median", "tool.slow_median_s"),
                   ("tool_slow_frac", "tool.slow_frac"), ("tool_sigma", "tool.sigma"), ("tool_max", "tool.max_s"),
                   ("arrival_spread", "arrival_spread_s"), ("group_size", "group_size"),
                   ("system_prompt", "system_prompt"))
#: the simulator's (ignored with --engine)
SIM_FLAGS = (("profile", "profile"), ("sim_engines", "engines"), ("kv_capacity", "kv_capacity"))
_RANGE_FLAGS = {"turns", "first_prompt", "tool_result", "output"}


def scenario_changes(args: Any, sc: Any, *, time_scale: float, caps_run: Sequence[int],
                     default_caps: Sequence[int]) -> list[str]:
    """What the flags of a ``kvgate bench`` run (``args``) changed in the workload or engines
    of its named scenario ``sc`` (a :class:`.scenarios.Scenario`), one ``--flag value`` each;
    empty for the scenario as it is named. A flag given with the scenario's own value
    changes nothing. ``caps_run``: the fixed caps that ran; they change the scenario when they
    are not the caps its sweep chose, ``default_caps`` (``--caps 40`` on 40 sessions is no gate,
    so "the best fixed cap" would compare nothing). The seed and the vocabulary only redraw token ids, and
    ``--engine`` is how the CPU scenarios are meant to run: none of them counts."""
    out = []

    def differs(dest: str, attr: str) -> bool:
        given = getattr(args, dest, None)
        if given is None:
            return False
        dflt = sc
        for part in attr.split("."):
            dflt = getattr(dflt, part)
        if dest in _RANGE_FLAGS:
            return parse_range(given) != parse_range(dflt)
        return given != dflt

    engine = bool(getattr(args, "engine", None))
    if getattr(args, "trace", None):
        out.append(f"--trace {args.trace}")
    else:
        out += [f"{flag_name(d)} {getattr(args, d)}" for d, a in WORKLOAD_FLAGS if differs(d, a)]
    if not engine:
        out += [f"{flag_name(d)} {getattr(args, d)}" for d, a in SIM_FLAGS if differs(d, a)]
        if getattr(args, "sim_prefill_metrics", None) is False:
            out.append("--no-sim-prefill-metrics")
    if time_scale != (1.0 if engine else sc.time_scale):
        out.append(f"--time-scale {time_scale:g}")
    if getattr(args, "steps", 1) > 1:
        out.append(f"--steps {args.steps}")  # the targets are a trainer's first step: the gate cold
    if caps_run and sorted(set(caps_run)) != sorted(set(default_caps)):
        out.append(f"caps {','.join(map(str, sorted(set(caps_run))))} "
                   f"(the scenario's sweep: {','.join(map(str, sorted(set(default_caps))))})")
    return out
