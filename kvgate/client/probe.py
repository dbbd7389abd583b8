"""The residency-probe interface (SPEC section 5) and a fake for tests.

A probe answers "what fraction of this prompt's leading blocks is in the prefix cache
right now", without queueing or running anything. The gate calls it only when rules 1-6
did not decide a turn. ``hit_ratio=None`` means unavailable; a probe that raises or
exceeds ``probe_timeout_s`` also counts as unavailable.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Protocol, Sequence, runtime_checkable


@dataclass(frozen=True)
class ProbeResult:
    hit_ratio: float | None
    cached_tokens: int = 0
    total_tokens: int = 0
    cached_blocks: int = 0
    detail: str = ""

    @property
    def available(self) -> bool:
        return self.hit_ratio is not None


UNAVAILABLE = ProbeResult(None, detail="unavailable")


@runtime_checkable
class ResidencyProbe(Protocol):
    def probe(self, session_id: str, prompt_ids: Sequence[int]) -> ProbeResult: ...


@runtime_checkable
class AsyncResidencyProbe(Protocol):
    async def aprobe(self, session_id: str, prompt_ids: Sequence[int]) -> ProbeResult: ...


def coerce(result: object) -> ProbeResult:
    """Accept a ProbeResult, a bare ratio, or None from user probes."""
    if isinstance(result, ProbeResult):
        r = result.hit_ratio
    elif result is None:
        return UNAVAILABLE
    elif isinstance(result, (int, float)) and not isinstance(result, bool):
        r = float(result)
        result = ProbeResult(r)
    else:
        return ProbeResult(None, detail=f"probe returned {type(result).__name__}")
    if r is not None and not (0.0 <= r <= 1.0):
        return ProbeResult(None, detail=f"probe returned hit_ratio {r} outside [0, 1]")
    return result  # type: ignore[return-value]


class FakeProbe:
    """A probe for tests: a fixed ratio per session (or a callable), counting its calls.

    ``ratios`` maps session id to a hit ratio (``None`` = unavailable); ``default`` is used
    for sessions not in the map; ``raises`` makes every call raise; ``delay_s`` sleeps first
    (to exercise the probe timeout).
    """

    def __init__(self, ratios: Mapping[str, float | None] | Callable[[str, Sequence[int]], float | None] | None = None,
                 default: float | None = None, raises: BaseException | None = None, delay_s: float = 0.0):
        self.ratios = ratios if ratios is not None else {}
        self.default = default
        self.raises = raises
        self.delay_s = delay_s
        self.calls: list[tuple[str, int]] = []

    def _answer(self, session_id: str, prompt_ids: Sequence[int]) -> ProbeResult:
        self.calls.append((session_id, len(prompt_ids)))
        if self.raises is not None:
            raise self.raises
        if callable(self.ratios):
            r = self.ratios(session_id, prompt_ids)
        else:
            r = self.ratios.get(session_id, self.default)
        return coerce(r)

    def probe(self, session_id: str, prompt_ids: Sequence[int]) -> ProbeResult:
        if self.delay_s:
            import time
            time.sleep(self.delay_s)
        return self._answer(session_id, prompt_ids)

    async def aprobe(self, session_id: str, prompt_ids: Sequence[int]) -> ProbeResult:
        if self.delay_s:
            import asyncio
            await asyncio.sleep(self.delay_s)
        return self._answer(session_id, prompt_ids)
