"""Engine clients for the benchmark: SGLang ``/generate`` and vLLM ``/v1/completions``.

The bench talks to engines over HTTP only, the way a rollout worker would.  Both clients
send token ids, ask for exactly ``max_new_tokens`` tokens (``ignore_eos``, temperature 0)
and return the generated token ids, so the next turn's prompt extends what the engine
cached.  Prefix-cache hit rates come from the engines' own Prometheus counters:

* SGLang: ``sglang:cached_tokens_total`` / ``sglang:prompt_tokens_total``;
* vLLM:   ``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total``.

Series that differ only by a rank label (tp/pp/ep rank) repeat one engine's value and are
aggregated by max; everything else (cache_source, dp rank, several engines) is summed.
"""
from __future__ import annotations

import asyncio
import functools
import hashlib
import math
from dataclasses import dataclass
from typing import Sequence
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ..._http import ENGINE_KEEPALIVE_EXPIRY_S, async_client
from ..sim.client import HttpPool
from ..._json import dumps as _dumps, loads as _loads
from ...control.promparse import select_lines

_JSON = {"content-type": "application/json"}

__all__ = ["GenResult", "Counters", "EngineClient", "SGLangClient", "VLLMClient", "parse_counters",
           "make_client"]

_RANK_LABELS = {"tp_rank", "pp_rank", "moe_ep_rank", "ep_rank", "pid", "attn_tp_rank", "attn_dp_rank"}

SGLANG_COUNTERS = {
    "hits": ("sglang:cached_tokens_total",),
    "queries": ("sglang:prompt_tokens_total",),
    "preemptions": ("sglang:num_retracted_requests_total",),
}
VLLM_COUNTERS = {
    "hits": ("vllm:prefix_cache_hits_total",),
    "queries": ("vllm:prefix_cache_queries_total",),
    "preemptions": ("vllm:num_preemptions_total",),
}


class EngineHTTPError(RuntimeError):
    """An engine answered a turn with a non-2xx status (the lean client's error; httpx raises its own)."""


@dataclass
class GenResult:
    output_ids: list[int]
    prompt_tokens: int
    cached_tokens: int | None  # None when the engine does not say


@dataclass
class Counters:
    """Cumulative engine counters (summed over engines); subtract two to get a window."""

    hits: float = 0.0
    queries: float = 0.0
    preemptions: float = 0.0
    ok: bool = True

    def __sub__(self, other: "Counters") -> "Counters":
        return Counters(self.hits - other.hits, self.queries - other.queries,
                        self.preemptions - other.preemptions, self.ok and other.ok)

    def __add__(self, other: "Counters") -> "Counters":
        return Counters(self.hits + other.hits, self.queries + other.queries,
                        self.preemptions + other.preemptions, self.ok and other.ok)

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.queries if self.queries > 0 else None


def parse_counters(text: str, names: dict[str, tuple[str, ...]]) -> Counters:
    """Read the counters ``names`` from Prometheus text (rank series by max, others summed)."""
    groups: dict[str, dict[tuple, float]] = {k: {} for k in names}
    wanted = {n: k for k, ns in names.items() for n in ns}
    for fam in text_string_to_metric_families(select_lines(text, set(wanted))):
        for s in fam.samples:
            key = wanted.get(s.name)
            if key is None or not math.isfinite(s.value):
                continue
            lab = tuple(sorted((k, v) for k, v in s.labels.items() if k not in _RANK_LABELS))
            g = groups[key]
            g[lab] = max(g.get(lab, float("-inf")), s.value)
    vals = {k: sum(g.values()) for k, g in groups.items()}
    return Counters(hits=vals.get("hits", 0.0), queries=vals.get("queries", 0.0),
                    preemptions=vals.get("preemptions", 0.0))


@functools.lru_cache(maxsize=4096)
def _session_hash(session_id: str) -> int:
    """One stable hash per session, for engine placement and the client shard (computed
    once per session, not twice per turn)."""
    return int.from_bytes(hashlib.blake2b(session_id.encode(), digest_size=8).digest(), "little")


def _pick(urls: Sequence[str], session_id: str) -> str:
    """Sticky placement by session hash when the bench itself has to choose an engine."""
    if len(urls) == 1:
        return urls[0]
    return urls[_session_hash(session_id) % len(urls)]


class EngineClient:
    """Base: ``generate_urls`` receive turns (a router, or engines picked by session hash);
    ``engine_urls`` are the engines themselves (metrics, probes, usage)."""

    kind = "?"
    counter_names: dict[str, tuple[str, ...]] = {}

    def __init__(self, generate_urls: Sequence[str], engine_urls: Sequence[str], *,
                 timeout_s: float = 600.0, max_connections: int = 512, lean: bool = False) -> None:
        if not generate_urls or not engine_urls:
            raise ValueError("need at least one engine URL")
        for u in list(generate_urls) + list(engine_urls):
            if not (u.startswith("http://") or u.startswith("https://")):
                raise ValueError(f"engine URL must start with http:// or https://, got {u!r}")
        self.generate_urls = [u.rstrip("/") for u in generate_urls]
        self.engine_urls = [u.rstrip("/") for u in engine_urls]
        self._timeout = httpx.Timeout(timeout_s, connect=10.0)
        # per shard, not divided: sessions do not hash evenly, and a shard's limit must not
        # become a concurrency cap the workload did not ask for
        self._limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections,
                                    keepalive_expiry=ENGINE_KEEPALIVE_EXPIRY_S)
        self._shards: list[httpx.AsyncClient | None] = [None] * self.SHARDS
        for i in range(self.SHARDS):  # now, not on a session's first turn inside the timed run
            self._client(i)
        # lean=True (the bench's own simulator): turns go through the simulator's lean HTTP/1.1
        # pool (kvgate.tools.sim.HttpPool) where the URL is plain http without a base path. httpx's
        # per-request machinery was a third of the bench process's CPU, and at time scale 0.02
        # the bench's CPU is model time. Real engines keep
        # httpx: the pool knows nothing of TLS, base paths or a server's keep-alive expiry.
        self._lean: dict[str, HttpPool] = {}
        for u in self.generate_urls if lean else ():
            parts = urlsplit(u)
            if parts.scheme == "http" and parts.path in ("", "/") and not parts.query:
                self._lean[u] = HttpPool(u, timeout_s)

    # Turns go through SHARDS clients picked by session: httpcore's pool looks at every
    # connection it holds (an expiry check that polls the socket) each time it assigns a
    # request, so one pool of N connections costs O(N) per request. With 40 sessions that
    # was an eighth of the bench's CPU, and at time scale 0.02 a millisecond of the bench's
    # CPU is 50 ms of model time (docs/benchmarks.md#time-scale).
    SHARDS = 16

    def _client(self, shard: int) -> httpx.AsyncClient:
        c = self._shards[shard]
        if c is None:
            c = self._shards[shard] = async_client(timeout=self._timeout, limits=self._limits,
                                                   trust_env=False)
        return c

    @property
    def http(self) -> httpx.AsyncClient:
        """The client for everything that is not a turn (metrics, usage, resets)."""
        return self._client(0)

    def http_for(self, session_id: str) -> httpx.AsyncClient:
        """The client a session's turns use (one shard per session, stable)."""
        return self._client(_session_hash(session_id) % self.SHARDS)

    async def _post_turn(self, base: str, path: str, body: bytes, session_id: str) -> bytes:
        """POST one turn's JSON body; the answer's body, or an error for a non-2xx answer."""
        pool = self._lean.get(base)
        if pool is None:
            r = await self.http_for(session_id).post(base + path, content=body, headers=_JSON)
            r.raise_for_status()
            return r.content
        status, _, data = await pool.post(path, body)
        if not 200 <= status < 300:
            text = data[:200].decode("utf-8", "replace").strip()
            raise EngineHTTPError(f"POST {base}{path}: HTTP {status}" + (f" -- body: {text}" if text else ""))
        return data

    async def aclose(self) -> None:
        for pool in self._lean.values():
            pool.close()
        shards, self._shards = self._shards, [None] * self.SHARDS
        for c in shards:
            if c is not None:
                await c.aclose()

    async def generate(self, session_id: str, prompt_ids: list[int], max_new_tokens: int) -> GenResult:
        raise NotImplementedError

    async def counters(self) -> Counters:
        async def one(url: str) -> Counters:
            try:
                r = await self.http.get(url + "/metrics", timeout=10.0)
                r.raise_for_status()
                return parse_counters(r.text, self.counter_names)
            except (httpx.HTTPError, ValueError):
                return Counters(ok=False)

        parts = await asyncio.gather(*(one(u) for u in self.engine_urls))
        total = Counters()
        for p in parts:
            total = total + p
        return total

    async def usage(self) -> list[dict]:
        """``GET /kvgate/usage`` of each engine (shared probe contract); errors -> healthy False."""
        async def one(url: str) -> dict:
            try:
                r = await self.http.get(url + "/kvgate/usage", timeout=5.0)
                r.raise_for_status()
                d = r.json()
                block = int(d["block_size"])
                cap = int(d["num_gpu_blocks"]) * block
                return {"url": url, "capacity_tokens": cap, "usage": float(d["usage"]), "healthy": cap > 0,
                        "block_size": block}
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                return {"url": url, "capacity_tokens": 0, "usage": None, "healthy": False, "block_size": None}

        return list(await asyncio.gather(*(one(u) for u in self.engine_urls)))

    reset_path = "/reset_prefix_cache"

    async def reset_prefix_cache(self) -> bool:
        """Best effort prefix-cache flush on every engine between policies (vLLM
        ``POST /reset_prefix_cache``, SGLang ``POST /flush_cache``); False if any failed."""
        ok = True
        for u in self.engine_urls:
            try:
                r = await self.http.post(u + self.reset_path, timeout=30.0)
                ok = ok and r.status_code < 400
            except httpx.HTTPError:
                ok = False
        return ok


class SGLangClient(EngineClient):
    kind = "sglang"
    counter_names = SGLANG_COUNTERS
    reset_path = "/flush_cache"

    async def generate(self, session_id: str, prompt_ids: list[int], max_new_tokens: int) -> GenResult:
        url = _pick(self.generate_urls, session_id)
        body = {"input_ids": prompt_ids,
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0,
                                    "ignore_eos": True}}
        d = _loads(await self._post_turn(url, "/generate", _dumps(body), session_id))
        if isinstance(d, list):
            d = d[0]
        meta = d.get("meta_info") or {}
        out = d.get("output_ids") or []
        cached = meta.get("cached_tokens")
        return GenResult(output_ids=[int(x) for x in out], prompt_tokens=int(meta.get("prompt_tokens", len(prompt_ids))),
                         cached_tokens=int(cached) if cached is not None else None)


class VLLMClient(EngineClient):
    kind = "vllm"
    counter_names = VLLM_COUNTERS

    def __init__(self, *a, model: str | None = None, **kw) -> None:
        super().__init__(*a, **kw)
        self.model = model

    async def _model(self) -> str:
        if self.model is None:
            r = await self.http.get(self.generate_urls[0] + "/v1/models", timeout=10.0)
            r.raise_for_status()
            self.model = r.json()["data"][0]["id"]
        return self.model

    async def generate(self, session_id: str, prompt_ids: list[int], max_new_tokens: int) -> GenResult:
        url = _pick(self.generate_urls, session_id)
        body = {"model": await self._model(), "prompt": prompt_ids, "max_tokens": max_new_tokens,
                "min_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True,
                "return_token_ids": True}
        d = _loads(await self._post_turn(url, "/v1/completions", _dumps(body), session_id))
        ch = d["choices"][0]
        out = ch.get("token_ids") or []
        usage = d.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens")
        return GenResult(output_ids=[int(x) for x in out],
                         prompt_tokens=int(usage.get("prompt_tokens", len(prompt_ids))),
                         cached_tokens=int(cached) if cached is not None else None)


def make_client(kind: str, generate_urls: Sequence[str], engine_urls: Sequence[str], **kw) -> EngineClient:
    if kind == "sglang":
        return SGLangClient(generate_urls, engine_urls, **kw)
    if kind == "vllm":
        return VLLMClient(generate_urls, engine_urls, **kw)
    raise ValueError(f"engine kind must be 'sglang' or 'vllm', got {kind!r}")
