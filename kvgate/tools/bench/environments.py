"""The engines a bench run drives: a fresh set per policy (``async with env.fresh() as client``).

:class:`SimEnv` restarts the SGLang simulator for each policy; :class:`RealEnv` resets the
prefix caches of real engines. Both know what bounds one request, so a workload the engines
would refuse is refused before the run (:mod:`.preflight`).
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from typing import AsyncIterator, Sequence

from .engines import EngineClient, make_client

__all__ = ["EngineEnv", "SimEnv", "RealEnv"]


class EngineEnv:
    """A fresh set of engines for one policy: ``async with env.fresh() as client``."""

    def fresh(self) -> contextlib.AbstractAsyncContextManager[EngineClient]:  # pragma: no cover
        raise NotImplementedError

    def describe(self) -> dict:
        return {}


class SimEnv(EngineEnv):
    """A fresh simulated SGLang cluster per policy (``kvgate.tools.sim.SimCluster``).

    The simulator runs in a child process (the bench, its poller and Redis share the
    other core).  Turns go straight to the engines; with several engines the bench places
    each session on one engine by a hash of its id (sticky, what a cache-aware router
    converges to), so the simulator's router is not started.
    """

    def __init__(self, profile: str, engines: int, time_scale: float, kv_capacity: int | None,
                 in_process: bool = False, prefill_metrics: bool = False) -> None:
        from kvgate.tools.sim import load_profile

        base = load_profile(profile)
        if kv_capacity is not None and (isinstance(kv_capacity, bool) or not isinstance(kv_capacity, int)
                                        or kv_capacity < base.block_size):
            raise ValueError(f"--kv-capacity must hold at least one block of profile {base.name} "
                             f"({base.block_size} tokens), got {kv_capacity!r}")
        self.profile = load_profile(profile, kv_capacity_tokens=kv_capacity) if kv_capacity is not None else base
        self.engines = engines
        self.time_scale = time_scale
        self.in_process = in_process
        self.prefill_metrics = prefill_metrics

    def describe(self) -> dict:
        return {"engine": "sglang-simulator (kvgate.tools.sim)", "profile": self.profile.name,
                "engines": self.engines, "kv_capacity_tokens": self.profile.kv_capacity_tokens,
                "pool_tokens": self.pool_tokens, "time_scale": self.time_scale,
                "profile_source": self.profile.source, "prefill_metrics": self.prefill_metrics}

    @property
    def pool_tokens(self) -> int:
        return self.profile.kv_capacity_tokens * self.engines

    @property
    def block_size(self) -> int:
        """The profile's KV block (page) size: re-prefill counts whole blocks only."""
        return self.profile.block_size

    def request_limit(self) -> tuple[int, str]:
        """The most tokens (prompt + output) one request may hold on a simulated engine, and
        why: its context length, or its KV pool less one block (kvgate.tools.sim.engine.validate)."""
        p = self.profile
        pool = (p.kv_capacity_tokens // p.block_size) * p.block_size
        if p.max_context <= pool - p.block_size:
            return p.max_context, f"profile {p.name}'s context length"
        return pool - p.block_size, f"profile {p.name}'s KV pool ({pool:,} tokens, less one block of {p.block_size})"

    @contextlib.asynccontextmanager
    async def fresh(self) -> AsyncIterator[EngineClient]:
        from kvgate.tools.sim import SimCluster

        cluster = SimCluster(self.engines, self.profile, time_scale=self.time_scale, router=False,
                             process=not self.in_process, health_check_interval_s=None,
                             prefill_metrics=self.prefill_metrics)
        starting = asyncio.ensure_future(asyncio.to_thread(cluster.start))
        try:
            await asyncio.shield(starting)
        except BaseException:
            # interrupted (Ctrl-C, SIGTERM) while the simulator starts: let the start finish
            # (it is bounded) and stop what it started, or its process outlives the bench
            with contextlib.suppress(BaseException):
                await starting
            await asyncio.to_thread(cluster.stop)
            raise
        client = None
        try:
            client = make_client("sglang", cluster.engine_urls, cluster.engine_urls, lean=True)
            yield client
        finally:
            if client is not None:
                await client.aclose()
            await asyncio.to_thread(cluster.stop)


class RealEnv(EngineEnv):
    """Real engines: prefix caches reset between policies (vLLM needs VLLM_SERVER_DEV_MODE=1)."""

    def __init__(self, kind: str, urls: Sequence[str], router: str | None, model: str | None) -> None:
        self.kind, self.urls, self.router, self.model = kind, list(urls), router, model
        self.pool_tokens: int | None = None
        self.engine_tokens: int | None = None  # the smallest engine's pool (/kvgate/usage)
        self.max_model_len: int | None = None  # vLLM's /v1/models says it
        self.block_size: int | None = None  # the engines' KV block, when /kvgate/usage gives one size
        self.reset_ok: list[bool] = []

    def describe(self) -> dict:
        return {"engine": self.kind, "urls": self.urls, "router": self.router,
                "pool_tokens": self.pool_tokens, "prefix_cache_reset": self.reset_ok}

    def _client(self) -> EngineClient:
        gen = [self.router] if self.router else self.urls
        kw = {"model": self.model} if self.kind == "vllm" else {}
        return make_client(self.kind, gen, self.urls, **kw)

    async def probe_pool(self, timeout_s: float = 5.0) -> int | None:
        """Check that every engine (and the router) answers ``GET /health`` with 2xx, read
        vLLM's ``max_model_len`` from ``/v1/models`` and the pool from ``/kvgate/usage`` (an
        engine without that route, as a real SGLang, leaves the pool unknown). ValueError
        when an engine does not answer or answers as no engine would; every call is bounded
        by ``timeout_s``."""
        import httpx

        c = self._client()
        try:
            async def health(u: str) -> str | None:
                try:
                    r = await c.http.get(u + "/health", timeout=timeout_s)
                except (httpx.HTTPError, httpx.InvalidURL, OSError, ValueError) as e:
                    return f"{u}: no answer to GET /health ({type(e).__name__}{': ' + str(e) if str(e) else ''})"
                if not 200 <= r.status_code < 300:
                    return f"{u}: GET /health answered HTTP {r.status_code} (is it the engine's base URL?)"
                return None

            targets = self.urls + ([self.router.rstrip("/")] if self.router else [])
            problems = [p for p in await asyncio.gather(*(health(u.rstrip("/")) for u in targets)) if p]
            if problems:
                raise ValueError("--engine: " + "; ".join(problems))
            if self.kind == "vllm":
                await self._read_model(c, timeout_s)
            us = await c.usage()
        finally:
            await c.aclose()
        caps = [u["capacity_tokens"] for u in us if u["healthy"]]
        self.pool_tokens = sum(caps) if caps else None
        self.engine_tokens = min(caps) if caps else None
        blocks = {u.get("block_size") for u in us if u["healthy"]}
        # re-prefill counts whole blocks only where every engine has the same, known block size
        self.block_size = blocks.pop() if len(blocks) == 1 and None not in blocks else None
        return self.pool_tokens

    async def _read_model(self, c: EngineClient, timeout_s: float) -> None:
        """The served model (``--model``, else the first) and its ``max_model_len``."""
        import httpx

        u = c.generate_urls[0]
        try:
            r = await c.http.get(u + "/v1/models", timeout=timeout_s)
            r.raise_for_status()
            data = r.json()["data"]
            ids = [m["id"] for m in data]
        except (httpx.HTTPError, ValueError, KeyError, TypeError, IndexError) as e:
            raise ValueError(f"--engine: {u}: GET /v1/models gave no model list ({type(e).__name__}: {e}); "
                             f"is it a vLLM server (--engine-kind)?") from None
        if not ids:
            raise ValueError(f"--engine: {u}: serves no model (GET /v1/models)")
        if self.model is not None and self.model not in ids:
            raise ValueError(f"--model {self.model}: not served by {u} (it serves {', '.join(map(str, ids))})")
        entry = data[ids.index(self.model)] if self.model is not None else data[0]
        mml = entry.get("max_model_len") if isinstance(entry, dict) else None
        if isinstance(mml, int) and not isinstance(mml, bool) and mml > 0:
            self.max_model_len = mml

    def request_limit(self) -> tuple[int, str] | None:
        """What the engines said bounds one request (vLLM's max_model_len, the smallest
        engine's KV pool), or None where they said nothing."""
        limits = []
        if self.max_model_len is not None:
            limits.append((self.max_model_len, "the engine's max_model_len (/v1/models)"))
        if self.engine_tokens is not None:
            limits.append((self.engine_tokens, "the smallest engine's KV pool (/kvgate/usage)"))
        return min(limits) if limits else None

    @contextlib.asynccontextmanager
    async def fresh(self) -> AsyncIterator[EngineClient]:
        client = self._client()
        # Wait (bounded) until the engines are idle, then reset their prefix caches.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            us = await client.usage()
            if all((u["usage"] or 0.0) == 0.0 for u in us):
                break
            await asyncio.sleep(0.5)
        ok = await client.reset_prefix_cache()
        self.reset_ok.append(ok)
        if not ok:
            import warnings

            warnings.warn(f"could not flush the prefix cache of {self.urls} (vLLM needs VLLM_SERVER_DEV_MODE=1); "
                          "policies after the first start warm", RuntimeWarning, stacklevel=2)
        try:
            yield client
        finally:
            await client.aclose()
