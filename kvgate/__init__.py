"""kvgate: a Redis-backed admission gate for agentic RL rollouts in front of SGLang and
vLLM engines. See README.md and docs/.

Public surface::

    kvgate.Gate / kvgate.AsyncGate        the gate (sync / asyncio), same methods
    kvgate.GateConfig                     every knob, validated, KVGATE_* overrides
    kvgate.EngineState, SnapshotResult    capacity snapshots
    kvgate.ProbeResult, ResidencyProbe, AsyncResidencyProbe, FakeProbe   residency probes
    kvgate.Preempted, AdmissionCancelled, AdmissionTimeout, KvgateError, RedisAccessDenied  exceptions
"""
from .client.aio import AsyncGate, AsyncLease
from .config import GateConfig
from .errors import AdmissionCancelled, AdmissionTimeout, KvgateError, Preempted, RedisAccessDenied, ScriptError
from .client.gate import Gate, Lease
from .client.probe import UNAVAILABLE, AsyncResidencyProbe, FakeProbe, ProbeResult, ResidencyProbe
from .client.snapshot import EngineState, SnapshotResult

__version__ = "0.1.0"

__all__ = [
    "Gate", "AsyncGate", "Lease", "AsyncLease", "GateConfig", "EngineState", "SnapshotResult",
    "ProbeResult", "ResidencyProbe", "AsyncResidencyProbe", "FakeProbe", "UNAVAILABLE",
    "Preempted", "AdmissionCancelled", "AdmissionTimeout", "KvgateError", "ScriptError",
    "RedisAccessDenied",
]
