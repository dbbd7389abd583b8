"""``kvgate bench``: an agentic rollout benchmark that shows what the gate buys.

See docs/benchmarks.md.  Modules: :mod:`.workload` (seeded sessions, JSONL trace replay),
:mod:`.engines` (SGLang / vLLM HTTP clients, hit rate from engine counters),
:mod:`.runner` (policies), :mod:`.report` (table, JSON, plots), :mod:`.cli`.
"""
from .workload import IntRange, ToolLatency, Workload, WorkloadSpec, generate, load_trace

__all__ = ["IntRange", "ToolLatency", "Workload", "WorkloadSpec", "generate", "load_trace"]
