"""``kvgate bench``: an agentic rollout benchmark that shows what the gate buys.

See docs/benchmarks.md. Modules, in the order a run uses them:

* :mod:`.flags` the command line; :mod:`.scenarios` the named scenarios and the workload a
  run builds from one (:mod:`.workload`: seeded sessions, :mod:`.trace`: JSONL trace replay);
* :mod:`.preflight` every check before anything runs, and each scenario's plan;
  :mod:`.environments` the simulator or real engines (:mod:`.engines`: their HTTP clients);
* :mod:`.policies` what is compared; :mod:`.sweep` the fixed-cap sweep and its widening;
* :mod:`.rounds` the rounds of one scenario; :mod:`.runner` one policy's step;
  :mod:`.gates` the gate and snapshot source of a gate policy; :mod:`.signals` SIGTERM;
* :mod:`.summary` what a step measured; :mod:`.checks` the targets; :mod:`.outcome` one
  scenario's result; :mod:`.table`, :mod:`.plots`, :mod:`.matrix` the output;
* :mod:`.cli` the entry point; :mod:`.host` the box; :mod:`.redis_embed` private Redis
  servers (the bench's, the tests', a Redis Cluster).
"""
from .trace import load_trace
from .workload import IntRange, ToolLatency, Workload, WorkloadSpec, generate

__all__ = ["IntRange", "ToolLatency", "Workload", "WorkloadSpec", "generate", "load_trace"]
