"""In-process residency probe for code that holds a vLLM engine object.

    engine = vllm.AsyncLLM.from_engine_args(...)        # or vllm.LLM(...), LLMEngine, an EngineCoreClient
    probe = InProcessVllmProbe(engine, timeout_s=0.5)
    agate = kvgate.AsyncGate.from_url(url, gate="g", probe=probe)    # uses probe.aprobe()

The probe sends the `kvgate_probe` UTILITY call that kvgate's vLLM plugin installs in EngineCore (the
plugin loads inside EngineCore through the `vllm.general_plugins` entry point: keep `VLLM_PLUGINS` unset or
include `kvgate` in it).  EngineCore answers between two engine steps, on its own thread; the probe never
enters the scheduler queue.  With data parallel, every engine core is asked and the one holding the most
leading blocks answers.  Failures and timeouts give `ProbeResult(hit_ratio=None, detail=...)`.

Engines handled:
- `AsyncLLM` (or its `AsyncMPClient`): `call_utility_async` / `call_utility_all_async`; `aprobe()` is the
  natural call.  `probe()` works from another thread when the probe knows the engine's event loop
  (`loop=`, or the loop `aprobe()` last ran on).
- `LLM` / `LLMEngine` with a background EngineCore process (`SyncMPClient`): the utility call with a bounded
  wait (`probe()`; `aprobe()` runs it in a thread).
- `LLM` with `VLLM_ENABLE_V1_MULTIPROCESSING=0` (`InprocClient`): EngineCore lives in the caller's process
  and is driven by the thread that calls `generate`; the probe calls the method directly (microseconds).
  Call it only from that thread, between `generate` calls (EngineCore is not thread-safe).

`vllm.LLM` is not thread-safe (its ZMQ input socket and the in-process EngineCore included): use one
thread to drive it. kvgate's `Gate` runs `probe()` on its worker pool while the calling thread waits in
`acquire()`, which is fine when that calling thread is the one driving the `LLM`.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

from kvgate.integrations._common import (
    PROBE_METHOD, USAGE_METHOD, ProbeResult, best_of, check_prompt_ids, check_session_id, check_timeout,
    parse_probe_payload, to_result, unavailable,
)
from kvgate._aio import wait_for

_NOT_LOADED_HINT = ("kvgate plugin not loaded in EngineCore: install kvgate in the engine's environment "
                    "and leave VLLM_PLUGINS unset or include 'kvgate'")


def _resolve(engine: Any) -> tuple[str, Any]:
    """-> ("direct", EngineCore) | ("async", async client) | ("sync", sync client)."""
    target = getattr(engine, "llm_engine", engine)          # LLM -> LLMEngine
    if hasattr(target, "scheduler") and hasattr(target, "request_block_hasher"):
        return "direct", target                              # an EngineCore itself
    client = getattr(target, "engine_core", target)         # AsyncLLM / LLMEngine -> engine-core client
    inner = getattr(client, "engine_core", None)            # InprocClient -> EngineCore
    if inner is not None and hasattr(inner, "scheduler"):
        return "direct", inner
    if hasattr(client, "call_utility_async"):
        return "async", client
    if hasattr(client, "call_utility"):
        return "sync", client
    raise ValueError(f"not a vLLM engine, LLM, AsyncLLM or engine-core client: {type(engine).__name__}")


class InProcessVllmProbe:
    """Residency probe for a vLLM engine held by this process (see the module docstring)."""

    def __init__(self, engine: Any, timeout_s: float = 0.5, loop: asyncio.AbstractEventLoop | None = None):
        self.mode, self.target = _resolve(engine)
        self.timeout_s = check_timeout(timeout_s)
        self.loop = loop
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        if self.mode == "direct":
            # the plugin may not have been loaded through entry points in this process (VLLM_PLUGINS)
            from kvgate.integrations.vllm_plugin import register
            register()

    # ------------------------------------------------------------------ raw calls
    def _direct(self, method: str, args: tuple) -> Any:
        fn = getattr(self.target, method, None)
        if fn is None:
            raise RuntimeError(_NOT_LOADED_HINT)
        return fn(*args)

    def _sync_call(self, method: str, args: tuple, timeout: float) -> list:
        """One utility call through a SyncMPClient with a bounded wait."""
        client = self.target
        results = getattr(client, "utility_results", None)
        send = getattr(client, "_send_input", None)
        if isinstance(results, dict) and send is not None:
            from vllm.v1.engine import EngineCoreRequestType
            call_id = uuid.uuid1().int >> 64
            fut: concurrent.futures.Future = concurrent.futures.Future()
            results[call_id] = fut  # the client's output thread resolves it; a late answer is just dropped
            send(EngineCoreRequestType.UTILITY, (0, call_id, method, args))
            return [fut.result(timeout=timeout)]
        # unknown client layout: the public call in a daemon worker, bounded wait
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="kvgate-vllm-probe")
        return [self._pool.submit(client.call_utility, method, *args).result(timeout=timeout)]

    async def _async_call(self, method: str, args: tuple) -> list:
        from kvgate.integrations.vllm_plugin import call_all_engines
        return await call_all_engines(self.target, method, *args)

    def _interpret(self, answers: list, n: int, t0: float) -> ProbeResult:
        parsed = [parse_probe_payload(a, total_tokens=n) for a in answers]
        best = best_of(parsed)
        ms = (time.monotonic() - t0) * 1e3
        return to_result(best, f"vllm {self.mode} {best.get('engine') or ''} "
                               f"(best of {len(parsed)}, {ms:.2f} ms)".replace("  ", " "))

    @staticmethod
    def _failure(e: BaseException, n: int) -> ProbeResult:
        msg = str(e) or e.__class__.__name__
        if "kvgate_probe" in msg or "kvgate_usage" in msg or "has no attribute" in msg:
            msg = f"{msg} ({_NOT_LOADED_HINT})"
        if isinstance(e, (TimeoutError, asyncio.TimeoutError, concurrent.futures.TimeoutError)):
            msg = "timeout"
        return unavailable(f"vllm probe unavailable: {msg}", total_tokens=n)

    # ------------------------------------------------------------------ probe interface
    def probe(self, session_id: str, prompt_ids: Sequence[int]) -> ProbeResult:
        check_session_id(session_id)
        ids = check_prompt_ids(prompt_ids)
        t0 = time.monotonic()
        try:
            if self.mode == "direct":
                answers = [self._direct(PROBE_METHOD, (ids,))]
            elif self.mode == "sync":
                answers = self._sync_call(PROBE_METHOD, (ids,), self.timeout_s)
            else:
                loop = self.loop
                if loop is None or loop.is_closed():
                    return unavailable("vllm probe: sync probe() on an AsyncLLM needs loop= (or call aprobe())",
                                       total_tokens=len(ids))
                try:
                    running = asyncio.get_running_loop()
                except RuntimeError:
                    running = None
                if running is loop:
                    return unavailable("vllm probe: probe() called on the engine's own event loop; use aprobe()",
                                       total_tokens=len(ids))
                fut = asyncio.run_coroutine_threadsafe(self._async_call(PROBE_METHOD, (ids,)), loop)
                try:
                    answers = fut.result(timeout=self.timeout_s)
                except BaseException:
                    fut.cancel()
                    raise
            return self._interpret(answers, len(ids), t0)
        except Exception as e:  # noqa: BLE001 - any failure is "unavailable"
            return self._failure(e, len(ids))

    async def aprobe(self, session_id: str, prompt_ids: Sequence[int]) -> ProbeResult:
        check_session_id(session_id)
        ids = check_prompt_ids(prompt_ids)
        t0 = time.monotonic()
        try:
            if self.mode == "async":
                self.loop = asyncio.get_running_loop()
                answers = await wait_for(self._async_call(PROBE_METHOD, (ids,)), self.timeout_s)
            elif self.mode == "direct":
                answers = [self._direct(PROBE_METHOD, (ids,))]
            else:
                answers = await wait_for(
                    asyncio.to_thread(self._sync_call, PROBE_METHOD, (ids,), self.timeout_s), self.timeout_s + 0.1)
            return self._interpret(answers, len(ids), t0)
        except Exception as e:  # noqa: BLE001
            return self._failure(e, len(ids))

    # ------------------------------------------------------------------ usage (cheap)
    def usage(self) -> dict:
        """`kvgate_usage()` of the engine (worst engine core with data parallel); raises on failure."""
        from kvgate.integrations.vllm_plugin import merge_usage
        if self.mode == "direct":
            return self._direct(USAGE_METHOD, ())
        if self.mode == "sync":
            return merge_usage(self._sync_call(USAGE_METHOD, (), self.timeout_s))
        if self.loop is None:
            raise RuntimeError("usage() on an AsyncLLM needs loop=; use ausage()")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:  # blocking here would stall the engine's loop until the timeout
            raise RuntimeError("usage() called on the engine's own event loop; use ausage()")
        fut = asyncio.run_coroutine_threadsafe(self._async_call(USAGE_METHOD, ()), self.loop)
        try:
            return merge_usage(fut.result(timeout=self.timeout_s))
        except BaseException:
            fut.cancel()
            raise

    async def ausage(self) -> dict:
        from kvgate.integrations.vllm_plugin import merge_usage
        if self.mode == "async":
            return merge_usage(await wait_for(self._async_call(USAGE_METHOD, ()), self.timeout_s))
        return await asyncio.to_thread(self.usage)

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None
