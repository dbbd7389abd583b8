"""Capacity snapshots: the public way to tell a gate what its engines hold.

The poller writes them from engine ``/metrics``; tests and users with their own metrics
pipeline call ``Gate.write_snapshot`` with the same ``EngineState`` list.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .._urls import normalize_base_url

#: the most KV tokens one engine may report: far above any real engine, and low enough
#: that a fleet's sums stay exact in the scripts (cjson keeps 14 significant digits)
MAX_ENGINE_TOKENS = 2**36


@dataclass(frozen=True)
class EngineState:
    """One engine in a snapshot.

    ``capacity_tokens``: KV tokens the engine can hold (SGLang ``max_total_num_tokens``,
    vLLM ``num_gpu_blocks * block_size``). ``usage`` (0..1) is taken as given; when it is
    None it is ``used_tokens / capacity_tokens``. Unhealthy engines count for nothing.
    ``prefill_s_per_token``: measured seconds of prefill per uncached prompt token (None when
    the engine does not say); shown by ``kvgate status``.
    ``prefill_load``: seconds of prefill per second of wall time, over windows of at least
    2 s, smoothed (the mean number of requests in their prefill phase; None when not measured).
    """

    engine_id: str
    capacity_tokens: int
    used_tokens: int | None = None
    usage: float | None = None
    healthy: bool = True
    hit_rate: float | None = None
    url: str | None = None
    kind: str = "sglang"
    prefill_s_per_token: float | None = None
    prefill_load: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.engine_id, str) or not self.engine_id:
            raise ValueError(f"engine_id must be a non-empty string, got {self.engine_id!r}")
        if isinstance(self.capacity_tokens, bool) or not isinstance(self.capacity_tokens, int) \
                or self.capacity_tokens < 0:
            raise ValueError(f"capacity_tokens of {self.engine_id} must be an int >= 0, got {self.capacity_tokens!r}")
        if self.capacity_tokens > MAX_ENGINE_TOKENS:
            raise ValueError(f"capacity_tokens of {self.engine_id} must be at most {MAX_ENGINE_TOKENS}, "
                             f"got {self.capacity_tokens}")
        if self.used_tokens is not None and (isinstance(self.used_tokens, bool) or not isinstance(self.used_tokens, int)
                                             or not 0 <= self.used_tokens <= MAX_ENGINE_TOKENS):
            raise ValueError(f"used_tokens of {self.engine_id} must be an int in [0, {MAX_ENGINE_TOKENS}], "
                             f"got {self.used_tokens!r}")
        if self.url is not None:
            try:
                normalize_base_url(self.url)
            except ValueError as e:
                raise ValueError(f"url of {self.engine_id}: {e}") from None
        for name in ("usage", "hit_rate"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, (int, float)) or math.isnan(v) or not 0.0 <= v <= 1.0):
                raise ValueError(f"{name} of {self.engine_id} must be in [0, 1], got {v!r}")
        for name in ("prefill_s_per_token", "prefill_load"):
            p = getattr(self, name)
            if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not math.isfinite(p)
                                  or p < 0):
                raise ValueError(f"{name} of {self.engine_id} must be a finite number >= 0, got {p!r}")
        if self.healthy and self.capacity_tokens == 0:
            raise ValueError(f"healthy engine {self.engine_id} reports capacity_tokens=0")

    @property
    def effective_usage(self) -> float:
        if self.usage is not None:
            return float(self.usage)
        if self.used_tokens is not None and self.capacity_tokens:
            return min(1.0, self.used_tokens / self.capacity_tokens)
        return 0.0

    def to_script(self) -> dict:
        return {"id": self.engine_id, "cap": self.capacity_tokens,
                "used": self.used_tokens if self.used_tokens is not None else -1,
                "usage": self.effective_usage, "healthy": 1 if self.healthy else 0,
                "hit": self.hit_rate if self.hit_rate is not None else -1,
                "url": self.url or "", "kind": self.kind,
                "pst": self.prefill_s_per_token if self.prefill_s_per_token is not None else -1,
                "pl": self.prefill_load if self.prefill_load is not None else -1}


@dataclass(frozen=True)
class SnapshotResult:
    epoch: int
    bumped: bool
    capacity_tokens: int
    usage: float
    n_healthy: int
