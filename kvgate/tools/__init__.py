"""Tools, not the gate: the benchmark, the SGLang engine simulator and real-engine test helpers.

They need the ``bench`` extra (``pip install 'kvgate[bench]'``); nothing in the gate imports them.
"""
from __future__ import annotations

import importlib.util

__all__ = ["BENCH_EXTRA_MODULES", "BENCH_INSTALL", "missing_bench_modules"]

#: what the ``bench`` extra installs that the tools import: the console (rich), the plots
#: (matplotlib), the embedded Redis without a redis-server binary (fakeredis), the simulator's
#: HTTP servers (starlette, uvicorn). orjson, also in the extra, is optional (kvgate._json).
BENCH_EXTRA_MODULES = ("rich", "matplotlib", "fakeredis", "starlette", "uvicorn")
BENCH_INSTALL = "pip install 'kvgate[bench]'"


def missing_bench_modules() -> list[str]:
    """The modules of :data:`BENCH_EXTRA_MODULES` that cannot be imported here."""
    return [m for m in BENCH_EXTRA_MODULES if importlib.util.find_spec(m) is None]
