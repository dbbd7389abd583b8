"""The box a bench ran on, recorded with its results.

A real CPU vLLM engine's prefill speed, and with it which policy wins the heavy run, is set
by the CPU's bfloat16 matrix instructions (docs/benchmarks.md#cpu-isa): the same workload
prefills at 0.09 ms per token with AMX and at ~3 ms with AVX2 only. ``describe()`` names the
highest of those levels the CPU reports, so a result says which class it was measured on.
It describes the host the bench runs on: that is the engines' host only where they run
beside it (as ``benchmarks/real_vllm.sh`` starts them), and an emulated older CPU
(``CPU_ISA``) is recorded by that wrapper, not here.
"""
from __future__ import annotations

import os
import platform
from typing import Iterable

# highest first; each level needs all of its flags (Linux /proc/cpuinfo names)
MATRIX_ISA_LEVELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("amx", ("amx_bf16", "amx_tile")),
    ("avx512_bf16", ("avx512_bf16",)),
    ("avx512", ("avx512f",)),
    ("avx2", ("avx2",)),
)


def matrix_isa(flags: Iterable[str]) -> str:
    """The highest level of ``MATRIX_ISA_LEVELS`` the flags cover, else ``"other"`` (flags
    were read and name none of them: an x86 CPU older than AVX2). ``describe()`` says
    ``"unknown"`` instead where no flags could be read at all."""
    have = set(flags)
    for name, needs in MATRIX_ISA_LEVELS:
        if all(f in have for f in needs):
            return name
    return "other"


def parse_cpuinfo(text: str) -> tuple[str | None, list[str]]:
    """The first processor's model name and flags from /proc/cpuinfo's text (x86 layout)."""
    model: str | None = None
    flags: list[str] = []
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = value.split()
    return model, flags


def describe(cpuinfo: str = "/proc/cpuinfo") -> dict:
    """``{cpu, matrix_isa, cpus, load_1m}``; ``matrix_isa`` is one of ``MATRIX_ISA_LEVELS``,
    ``"other"`` where the CPU's flags name none of them, or ``"unknown"`` where they cannot be
    read (not Linux, not x86); ``load_1m`` is absent where there is no load average."""
    try:
        with open(cpuinfo) as f:
            model, flags = parse_cpuinfo(f.read())
    except OSError:
        model, flags = None, []
    out: dict = {"cpu": model or platform.processor() or platform.machine() or "unknown",
                 "matrix_isa": matrix_isa(flags) if flags else "unknown",
                 "cpus": os.cpu_count()}
    try:
        out["load_1m"] = round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        pass
    return out


def summary_line(host: dict) -> str:
    load = f", load {host['load_1m']}" if "load_1m" in host else ""
    return f"host: {host['cpu']}, {host['cpus']} CPUs, matrix ISA {host['matrix_isa']}{load}"
