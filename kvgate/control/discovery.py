"""Engine discovery: from an sgl-router (``GET /workers``, falling back to ``GET /list_workers``)
or from a static list of base URLs; plus a bounded HTTP GET used by the poller.

Every request here has a connect timeout, a read timeout, an overall deadline (a server that
trickles one byte a second cannot hold a tick) and a response-size limit (the body is streamed
and reading stops past ``max_body_bytes``).
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Iterable, Sequence
from urllib.parse import urlsplit

import httpx

from .._aio import wait_for
from .._urls import normalize_base_url

__all__ = [
    "Endpoint",
    "DiscoveryError",
    "BodyTooLarge",
    "HttpError",
    "normalize_base_url",
    "fetch_limited",
    "parse_workers",
    "Discovery",
    "DEFAULT_MAX_BODY_BYTES",
]

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024  # a 64-rank SGLang /metrics is well under 2 MiB


class DiscoveryError(RuntimeError):
    """The router could not be asked (unreachable, timed out, or answered nonsense)."""


class HttpError(RuntimeError):
    """A bounded request failed: connection error, timeout, non-2xx status."""


class BodyTooLarge(HttpError):
    """The response body exceeded the size limit; reading stopped."""


@dataclass(frozen=True)
class Endpoint:
    """One engine base URL as discovered."""

    url: str
    healthy: bool = True
    source: str = "static"  # "static" | "workers" | "list_workers"
    model_id: str | None = None
    worker_type: str | None = None
    draining: bool = False


def make_timeout(timeout_s: float) -> httpx.Timeout:
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    return httpx.Timeout(connect=timeout_s, read=timeout_s, write=timeout_s, pool=timeout_s)


async def fetch_limited(
    client: httpx.AsyncClient,
    url: str,
    *,
    timeout_s: float,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    method: str = "GET",
    json_body: object = None,
) -> bytes:
    """One request with an overall deadline of ``timeout_s`` and a body capped at
    ``max_body_bytes``.  Returns the body of a 2xx answer; raises :class:`HttpError` (or
    :class:`BodyTooLarge`) for anything else.  Never raises other exceptions except
    cancellation."""

    async def _go() -> bytes:
        kw = {"timeout": make_timeout(timeout_s)}
        if json_body is not None:
            kw["json"] = json_body
        async with client.stream(method, url, **kw) as resp:
            if not 200 <= resp.status_code < 300:
                raise HttpError(f"{method} {url}: HTTP {resp.status_code}")
            declared = resp.headers.get("content-length")
            if declared and declared.isdigit() and int(declared) > max_body_bytes:
                raise BodyTooLarge(f"{method} {url}: body of {declared} bytes exceeds {max_body_bytes}")
            chunks: list[bytes] = []
            got = 0
            async for chunk in resp.aiter_bytes():
                got += len(chunk)
                if got > max_body_bytes:
                    raise BodyTooLarge(f"{method} {url}: body exceeds {max_body_bytes} bytes")
                chunks.append(chunk)
            return b"".join(chunks)

    try:
        return await wait_for(_go(), timeout=timeout_s)
    except HttpError:
        raise
    except asyncio.TimeoutError:
        raise HttpError(f"{method} {url}: timed out after {timeout_s}s") from None
    except httpx.HTTPError as e:
        raise HttpError(f"{method} {url}: {type(e).__name__}: {e}"[:300]) from None
    except (OSError, ValueError) as e:  # odd transports / malformed URLs
        raise HttpError(f"{method} {url}: {type(e).__name__}: {e}"[:300]) from None


def parse_workers(payload: object, *, source: str) -> list[Endpoint]:
    """Decode a router answer: ``/workers`` -> ``{"workers": [{"url", "is_healthy", ...}]}``,
    ``/list_workers`` -> ``{"urls": [...]}``.  Raises ValueError when the shape is wrong.

    Workers with ``@<dp_rank>`` suffixes (sgl-router ``--dp-aware``) collapse to one base URL
    (the engine's /metrics reports every DP rank); it is healthy if any of its entries is.
    Prefill workers of a PD-disaggregated pool are kept (they hold KV too).
    """
    if not isinstance(payload, dict):
        raise ValueError(f"router answer is not a JSON object: {type(payload).__name__}")
    found: dict[str, Endpoint] = {}
    if source == "workers":
        workers = payload.get("workers")
        if not isinstance(workers, list):
            raise ValueError("router /workers answer has no 'workers' list")
        for w in workers:
            if not isinstance(w, dict):
                continue
            raw = w.get("url") or w.get("id")
            try:
                url = normalize_base_url(raw)
            except ValueError:
                continue
            healthy = w.get("is_healthy", True) is True
            draining = w.get("draining", False) is True
            ep = Endpoint(url=url, healthy=healthy and not draining, source=source,
                          model_id=_str_or_none(w.get("model_id")),
                          worker_type=_str_or_none(w.get("worker_type")), draining=draining)
            prev = found.get(url)
            if prev is None or (ep.healthy and not prev.healthy):
                found[url] = ep
    elif source == "list_workers":
        urls = payload.get("urls")
        if not isinstance(urls, list):
            raise ValueError("router /list_workers answer has no 'urls' list")
        for raw in urls:
            try:
                url = normalize_base_url(raw)
            except ValueError:
                continue
            found.setdefault(url, Endpoint(url=url, healthy=True, source=source))
    else:
        raise ValueError(f"unknown router source {source!r}")
    return list(found.values())


def _str_or_none(v) -> str | None:
    return v if isinstance(v, str) else None


class Discovery:
    """Where the engines are.  Exactly one of ``router`` or ``engines``."""

    def __init__(
        self,
        *,
        router: str | None = None,
        engines: Sequence[str] | None = None,
        timeout_s: float = 2.0,
        max_body_bytes: int = 1024 * 1024,
    ) -> None:
        if (router is None) == (not engines):
            raise ValueError("give exactly one of router= or engines=[...]")
        make_timeout(timeout_s)
        if not (isinstance(max_body_bytes, int) and max_body_bytes > 0):
            raise ValueError(f"max_body_bytes must be a positive int, got {max_body_bytes!r}")
        self.router = normalize_base_url(router) if router is not None else None
        self.engines: tuple[str, ...] = tuple(dict.fromkeys(normalize_base_url(u) for u in (engines or ())))
        self.timeout_s = float(timeout_s)
        self.max_body_bytes = max_body_bytes
        self.last_source: str | None = None

    async def discover(self, client: httpx.AsyncClient) -> list[Endpoint]:
        """All known engines with their router-reported health.

        Raises :class:`DiscoveryError` when the router cannot be asked at all; the poller then
        writes no snapshot (clients go ``degraded`` once the last one is stale)."""
        if self.router is None:
            self.last_source = "static"
            return [Endpoint(url=u) for u in self.engines]
        errors: list[str] = []
        for path, source in (("/workers", "workers"), ("/list_workers", "list_workers")):
            try:
                body = await fetch_limited(client, self.router + path, timeout_s=self.timeout_s,
                                           max_body_bytes=self.max_body_bytes)
                eps = parse_workers(json.loads(body), source=source)
            except (HttpError, ValueError) as e:  # json.JSONDecodeError is a ValueError
                errors.append(f"{path}: {e}")
                continue
            self.last_source = source
            return eps
        self.last_source = None
        raise DiscoveryError(f"router {self.router} unusable: " + "; ".join(errors))


def dedupe_urls(urls: Iterable[str]) -> list[str]:
    """Normalized, de-duplicated base URLs in first-seen order (ValueError on a bad one)."""
    return list(dict.fromkeys(normalize_base_url(u) for u in urls))
