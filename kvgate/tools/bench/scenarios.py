"""The named scenarios of ``kvgate bench``, and the workload a run builds from one and its flags.

Each scenario is a regime the gate must handle with its default knobs (docs/benchmarks.md
says why each exists): the defaults of its workload and engines; every value can be
overridden by a flag (:mod:`.flags`), which then marks the run's checks as made on a
modified scenario.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from .trace import load_trace
from .workload import VOCAB_DEFAULT, ToolLatency, Workload, WorkloadSpec, generate, parse_range

__all__ = ["Scenario", "SCENARIOS", "build_workload", "workload_vocab"]


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
    group_size: int = 1  # samples per task (GRPO's n): its samples send one first prompt
    system_prompt: int = 0  # leading tokens of every first prompt that are one system prompt


# The CPU vLLM measurements of ENGINES.md: one lognormal, median 0.2 s, p90 1.5 s.
_CPU_TOOL = ToolLatency(fast_median_s=0.2, slow_median_s=1.5, slow_frac=0.0,
                        sigma=math.log(1.5 / 0.2) / 1.2816, max_s=10.0)
# Slow tools without a fast mode (builds, test runs, searches): one lognormal around `median`,
# narrow enough that sessions of equal turns live about equally long.
def _slow_tools(median_s: float, sigma: float) -> ToolLatency:
    return ToolLatency(fast_median_s=median_s, slow_median_s=median_s, slow_frac=0.0, sigma=sigma, max_s=30.0)


SCENARIOS: dict[str, Scenario] = {
    # Working set several times the pool: the regime kvgate exists for.
    "default": Scenario(
        description="KV pressure: the sessions' final contexts add up to ~3x the KV pool",
        profile="gpu-h100-30b", sessions=40, turns="16-32", first_prompt="1500-2500",
        tool_result="100-400", output="30-120", time_scale=0.02),
    # Context sizes of the published agent traces: the thoughtworks agentic-coding-trajectories
    # card gives a p50 deepest prompt of ~24k tokens; these sessions end at ~24k on average.
    # Re-prefill is expensive here (a 16k-token prefill is 1.6 s on the GPU profile).
    "long-context": Scenario(
        description="KV pressure with trace-sized contexts: 16 sessions ending at ~24k tokens (~2.9x the pool)",
        profile="gpu-h100-30b", sessions=16, turns="16-32", first_prompt="6000-10000",
        tool_result="300-800", output="50-150", time_scale=0.02),
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
    # On the simulator at a quarter of real time: the profile's costs are 3 ms a decode step
    # and up, 2.5 ms per prefilled token, so the bench's own millisecond round trips stay small
    # next to them; side by side with time scale 1 every policy's wall-clock was within 8 % of
    # four times its own and the ratios kept (docs/benchmarks.md#scenarios). Real engines
    # (--engine) run at their own speed.
    "cpu-heavy": Scenario(
        description="12 sessions x 12 turns on an 80-block (2,560-token) cache, heavier CPU model profile",
        profile="cpu-vllm-heavy", sessions=12, turns="12", first_prompt="250-350", tool_result="30-60",
        output="20-30", time_scale=0.25, tool=_CPU_TOOL, vocab=1000),
    # KV pressure (the working set ~2.4x a 32k-token pool, so no gate evicts) but a re-prefill
    # of a whole context (<= 0.35 s on the GPU profile) is small next to the 8 s tool calls,
    # and the engine is idle most of the time: holding a session back costs more than its
    # misses. No gate should win, and every fixed cap lose to it (equal turns and a narrow
    # tool spread make a cap of n-1 start its last session about a session's life late).
    "cheap-prefill": Scenario(
        description="prefill cheap next to the tools: 24 sessions, 8 s tool calls, working set ~2.4x a 32k pool",
        profile="gpu-h100-30b", kv_capacity=32768, sessions=24, turns="12", first_prompt="800-1200",
        tool_result="100-200", output="30-60", time_scale=0.02, tool=_slow_tools(8.0, 0.5)),
    # The heavier CPU model's measured prefill (2.5 ms per token) with a 256-block cache:
    # refilling the pool cold takes ~20 s, several 3 s tool calls, so every session that loses
    # its prefix while it waits on a tool pays seconds to get it back, and no gate thrashes.
    # The best fixed cap, which keeps as many sessions as fit, should win big (>= 1.5x).
    "dear-prefill": Scenario(
        description="prefill dear with slow tools: heavier CPU model profile, 8,192-token pool, 3 s tool calls",
        profile="cpu-vllm-heavy", kv_capacity=8192, sessions=12, turns="10", first_prompt="500-700",
        tool_result="60-100", output="20-30", time_scale=0.1, tool=_slow_tools(3.0, 0.6), vocab=1000),
    # The default scenario's sessions arriving over the first 120 s of the step (about a
    # session's life) instead of all at once, with more of them so the pool stays under
    # pressure: the gate sees its load grow and its first sessions end while others arrive.
    "staggered": Scenario(
        description="KV pressure with sessions arriving over 120 s: 48 default-shaped sessions",
        profile="gpu-h100-30b", sessions=48, turns="16-32", first_prompt="1500-2500",
        tool_result="100-400", output="30-120", time_scale=0.02, arrival_spread_s=120.0),
    # GRPO: n samples of every task, each re-sending the task's prompt, every session starting
    # with the same system prompt. The engines' prefix caches store a shared prefix once; a
    # ledger that charged it per session would think the pool 8x fuller than it is at the start.
    # The default scenario's turns and tools, the first prompt a 2k system prompt and a 4k task.
    "grpo": Scenario(
        description="GRPO groups: 8 tasks x 8 samples, a 6k first prompt per task (2k of it one system "
                    "prompt), default turns and tools",
        profile="gpu-h100-30b", sessions=64, turns="8-16", first_prompt="6144", tool_result="100-400",
        output="30-120", time_scale=0.02, group_size=8, system_prompt=2048),
    # The same groups with trace-sized histories (long-context's tool results and outputs): the
    # sessions' own parts come to outweigh the shared prefix as they grow.
    "grpo-long": Scenario(
        description="GRPO groups with trace-sized histories: 4 tasks x 8 samples, a 10k first prompt "
                    "(2k system), sessions ending at ~22k tokens",
        profile="gpu-h100-30b", sessions=32, turns="12-24", first_prompt="10240", tool_result="300-800",
        output="50-150", time_scale=0.02, group_size=8, system_prompt=2048),
}


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
        vocab=vocab,
        group_size=args.group_size if args.group_size is not None else sc.group_size,
        system_prompt=args.system_prompt if args.system_prompt is not None else sc.system_prompt)
    return generate(spec, seed=args.seed)
