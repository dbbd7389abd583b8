"""The residency-probe interface (SPEC section 5) and a fake for tests.

A probe answers "what fraction of this prompt's leading blocks is in the prefix cache
right now", without queueing or running anything. The gate calls it only when rules 1-6
did not decide a turn. ``hit_ratio=None`` means unavailable; a probe that raises or
exceeds ``probe_timeout_s`` also counts as unavailable.
"""
from __future__ import annotations

import concurrent.futures
import inspect
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

#: threads that run a blocking probe, per gate; a probe still running past its timeout keeps its thread
PROBE_THREADS = 4


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


class _FunctionProbe:
    """A plain function ``(session_id, prompt_ids) -> ratio | ProbeResult | None`` as a probe."""

    def __init__(self, fn: Callable):
        self.probe = fn


class _AsyncFunctionProbe:
    """An ``async def (session_id, prompt_ids)`` function as a probe."""

    def __init__(self, fn: Callable):
        self.aprobe = fn


def as_probe(probe: Any, *, blocking: bool) -> Any:
    """What a gate calls to probe: None (no probe), an object with ``probe(session_id,
    prompt_ids)`` and/or ``async aprobe(...)``, or a plain function of the same arguments
    (wrapped: an ``async def`` one as ``aprobe``, any other as ``probe``). A probe answers a
    ``ProbeResult``, a bare hit ratio, or None (unavailable). ``blocking``: the gate calls
    ``probe()`` only (the sync gate). Anything else is a TypeError, never a probe that is
    silently "unavailable"."""
    if probe is None:
        return None
    has_sync = callable(getattr(probe, "probe", None))
    has_async = callable(getattr(probe, "aprobe", None))
    if not (has_sync or has_async):
        if not callable(probe):
            raise TypeError(f"probe must be an object with probe(session_id, prompt_ids) or async "
                            f"aprobe(session_id, prompt_ids), or such a function; got {type(probe).__name__}")
        is_async = inspect.iscoroutinefunction(probe) or inspect.iscoroutinefunction(getattr(probe, "__call__", None))
        probe = _AsyncFunctionProbe(probe) if is_async else _FunctionProbe(probe)
        has_sync = not is_async
    if blocking and not has_sync:
        raise TypeError("kvgate.Gate calls probe(session_id, prompt_ids) and this probe is async only "
                        "(aprobe, or an async def): use kvgate.AsyncGate, or give it a blocking probe()")
    return probe


class ProbeThreads:
    """A gate's own pool of ``PROBE_THREADS`` for blocking probes (both gates use it: the
    async gate must not lend the event loop's default executor to a probe, which redis-py's
    asyncio client needs to resolve host names). ``submit`` answers a future, or an
    unavailable result at once when every thread is still busy (a probe hanging past its
    timeout keeps its thread) or the pool is shut down; a child of ``fork`` gets a new pool."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pid = os.getpid()
        self.running = 0

    def submit(self, fn: Callable, session_id: str, prompt_ids: Any) -> "concurrent.futures.Future | ProbeResult":
        with self._lock:
            if self._pid != os.getpid():  # forked: the pool's threads stayed in the parent
                self._pool, self.running, self._pid = None, 0, os.getpid()
            if self.running >= PROBE_THREADS:
                return ProbeResult(None, detail="probe failed: all probe threads busy")
            self.running += 1
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=PROBE_THREADS,
                                                                   thread_name_prefix="kvgate-probe")
            pool = self._pool
        try:
            fut = pool.submit(fn, session_id, prompt_ids)
        except RuntimeError as e:  # the gate was closed
            self._done(None)
            return ProbeResult(None, detail=f"probe failed: {e}")
        fut.add_done_callback(self._done)
        return fut

    def _done(self, _fut: Any) -> None:
        with self._lock:
            self.running -= 1

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


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
