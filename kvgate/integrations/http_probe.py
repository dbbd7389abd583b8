"""HTTP residency probe: asks engines' `POST /kvgate/probe` (the vLLM plugin route, or the SGLang
simulator's identical route) how much of a prompt's leading blocks they hold.

    probe = HttpProbe(["http://e1:8000", "http://e2:8000"])          # fixed list
    probe = HttpProbe(gate.engine_urls)                               # engines of the latest snapshot
    probe = HttpProbe(agate.engine_urls)                              # AsyncGate: async source, aprobe()
    probe = HttpProbe(url_for_session=lambda sid: router_pick(sid))   # the engine that serves the session
    gate = kvgate.Gate.from_url(url, gate="g", probe=probe)

Without a session mapping every engine is asked concurrently and the best answer (most cached tokens)
wins: the router sends the session's next turn to where its prefix lives when it is prefix-aware, and a
session whose prefix is resident nowhere has nothing to protect.  Every call is bounded by `timeout_s`
in total; an engine that fails, times out or answers garbage is skipped, and when none answers the
result is `ProbeResult(hit_ratio=None, detail=...)` (unavailable: the gate falls back per SPEC rule 7/8).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from kvgate._http import ENGINE_KEEPALIVE_EXPIRY_S, async_client, sync_client
from kvgate._json import dumps as _dumps
from kvgate._json import loads as _loads
from kvgate._urls import normalize_base_url
from kvgate.integrations._common import (
    ProbeResult, best_of, check_prompt_ids, check_session_id, check_timeout, parse_probe_payload, to_result,
    unavailable,
)

PROBE_PATH = "/kvgate/probe"
# identity: a compressed answer could expand past the size cap inside one chunk (a gzip bomb)
_JSON = {"Content-Type": "application/json", "Accept-Encoding": "identity"}
MAX_RESPONSE_BYTES = 64 * 1024
# idle connections expire before the engine's server drops them (a probe sent on a closing one
# fails, and the gate then decides without residency)
PROBE_LIMITS = httpx.Limits(max_connections=64, max_keepalive_connections=32,
                            keepalive_expiry=ENGINE_KEEPALIVE_EXPIRY_S)

UrlSource = Sequence[str] | Callable[[], Sequence[str]]


def _check_url(u: Any) -> str:
    """The one engine-URL check of kvgate (kvgate._urls): a router's ``@dp`` suffix is
    dropped, and a query, fragment, userinfo or missing host is an error, not a request to
    some other host or path."""
    if not isinstance(u, str):
        raise ValueError(f"engine base URL must be an http(s) URL string, got {u!r}")
    return normalize_base_url(u)


class _BadUrl(str):
    """A dynamic source's URL that failed _check_url: asking it answers ``why`` at once."""

    def __new__(cls, raw: str, why: str) -> "_BadUrl":
        s = super().__new__(cls, raw)
        s.why = why
        return s


def _checked(u: Any) -> str:
    try:
        return _check_url(u)
    except ValueError as e:
        return _BadUrl(u if isinstance(u, str) else repr(u), str(e))


class _Answer(Exception):
    """An engine's answer that is not a probe answer (status, size, encoding, too slow)."""


def _start(resp: httpx.Response) -> None:
    if resp.status_code != 200:
        raise _Answer(f"HTTP {resp.status_code}")
    enc = resp.headers.get("content-encoding", "identity").strip().lower()
    if enc not in ("", "identity"):
        raise _Answer(f"compressed answer ({enc})")
    declared = resp.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_RESPONSE_BYTES:
        raise _Answer("answer too large")


def _add(chunks: list[bytes], got: int, chunk: bytes, deadline: float) -> int:
    got += len(chunk)
    if got > MAX_RESPONSE_BYTES:
        raise _Answer("answer too large")
    if time.monotonic() > deadline:
        raise httpx.ReadTimeout("the answer took longer than the probe's timeout")
    chunks.append(chunk)
    return got


class HttpProbe:
    """Residency probe over HTTP (sync `probe()` and async `aprobe()`)."""

    def __init__(self, base_urls: UrlSource | None = None, *,
                 url_for_session: Callable[[str], str | Sequence[str] | None] | None = None,
                 timeout_s: float = 0.5, path: str = PROBE_PATH, headers: dict[str, str] | None = None,
                 send_session_id: bool = True):
        if base_urls is None and url_for_session is None:
            raise ValueError("HttpProbe needs base_urls (a list or a callable) or url_for_session")
        if callable(base_urls) and not isinstance(base_urls, (str, list, tuple)):
            self._urls_fn: Callable[[], Sequence[str]] | None = base_urls  # type: ignore[assignment]
            self._urls: list[str] = []
        else:
            self._urls_fn = None
            if isinstance(base_urls, str):
                base_urls = [base_urls]
            self._urls = [_check_url(u) for u in (base_urls or [])]
        if url_for_session is not None and not callable(url_for_session):
            raise ValueError("url_for_session must be callable")
        if not isinstance(path, str) or not path.startswith("/"):
            raise ValueError("path must start with '/'")
        self.url_for_session = url_for_session
        self.timeout_s = check_timeout(timeout_s)
        self.path = path
        self.headers = dict(headers or {})
        self.send_session_id = bool(send_session_id)
        self._client: httpx.Client | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._aclients: dict[int, tuple[asyncio.AbstractEventLoop, httpx.AsyncClient]] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ which engines
    def _targets(self, session_id: str) -> tuple[list[str], str]:
        """Engines to ask for this session, and a note on how they were chosen (sync sources)."""
        picked = self.url_for_session(session_id) if self.url_for_session is not None else None
        if inspect.isawaitable(picked):
            picked.close()
            raise ValueError("url_for_session is async: use aprobe()")
        if picked:
            return self._urls_of(picked), "session"
        if self._urls_fn is not None:
            urls = self._urls_fn()
            if inspect.isawaitable(urls):
                urls.close()
                raise ValueError("the URL source is async (e.g. AsyncGate.engine_urls): use aprobe()")
            return self._urls_of(urls), "all"
        return list(self._urls), "all"

    async def _atargets(self, session_id: str) -> tuple[list[str], str]:
        """Like _targets, awaiting async sources (AsyncGate.engine_urls, an async session map)."""
        picked = self.url_for_session(session_id) if self.url_for_session is not None else None
        if inspect.isawaitable(picked):
            picked = await picked
        if picked:
            return self._urls_of(picked), "session"
        if self._urls_fn is not None:
            urls = self._urls_fn()
            if inspect.isawaitable(urls):
                urls = await urls
            return self._urls_of(urls), "all"
        return list(self._urls), "all"

    @staticmethod
    def _urls_of(picked: Any) -> list[str]:
        """A dynamic source's URLs, each checked once here: a bad one fails that engine only
        (asking it answers why), not the answers of the others."""
        if isinstance(picked, str):
            picked = [picked]
        return [_checked(u) for u in (picked or [])]

    def _body(self, session_id: str, ids: list[int]) -> bytes:
        """The request body, encoded once for every engine asked (orjson when installed:
        prompts are long lists of ints, and encoding them dominated the client's CPU)."""
        body: dict[str, Any] = {"prompt_ids": ids}
        if self.send_session_id:
            body["session_id"] = session_id
        return _dumps(body)

    # ------------------------------------------------------------------ answers
    @staticmethod
    def _decode(url: str, raw: bytes, n: int) -> dict:
        try:
            payload = _loads(raw)
        except ValueError as e:
            raise ValueError(f"not JSON ({e.__class__.__name__})") from None
        answer = parse_probe_payload(payload, total_tokens=n)
        answer["url"] = url
        return answer

    def _combine(self, results: list[tuple[str, dict | str]], how: str, n: int, t0: float) -> ProbeResult:
        good = [r for _, r in results if isinstance(r, dict)]
        errors = [f"{u}: {r}" for u, r in results if isinstance(r, str)]
        ms = (time.monotonic() - t0) * 1e3
        if not good:
            why = "; ".join(errors) if errors else "no engine to ask"
            return unavailable(f"http probe unavailable ({how}, {ms:.1f} ms): {why}", total_tokens=n)
        best = best_of(good)
        detail = f"{best['url']} ({how}, best of {len(good)}/{len(results)}, {ms:.1f} ms)"
        if errors:
            detail += "; failed: " + "; ".join(errors)
        return to_result(best, detail)

    # ------------------------------------------------------------------ sync
    def _sync_client(self) -> httpx.Client:
        with self._lock:
            if self._client is None:
                # trust_env=False: engines are asked directly, as by every other engine client
                # of kvgate (an HTTP_PROXY meant for the internet would get the prompt ids)
                self._client = sync_client(timeout=httpx.Timeout(self.timeout_s), headers=self.headers,
                                            limits=PROBE_LIMITS, trust_env=False)
            return self._client

    def _ask_sync(self, client: httpx.Client, url: str, body: bytes, n: int) -> dict | str:
        # streamed, capped at MAX_RESPONSE_BYTES and at timeout_s in all: httpx's timeouts are
        # per chunk, and an endless body kept a pool thread reading (and growing) forever
        deadline = time.monotonic() + self.timeout_s
        if isinstance(url, _BadUrl):
            return url.why
        try:
            with client.stream("POST", url + self.path, content=body, headers=_JSON) as resp:
                _start(resp)
                chunks: list[bytes] = []
                got = 0
                for chunk in resp.iter_raw():
                    got = _add(chunks, got, chunk, deadline)
            return self._decode(url, b"".join(chunks), n)
        except httpx.TimeoutException:
            return "timeout"
        except (_Answer, ValueError) as e:
            return str(e)
        except Exception as e:  # noqa: BLE001 - httpx.InvalidURL, a client closed meanwhile: this engine only
            return f"{e.__class__.__name__}: {e}"

    def probe(self, session_id: str, prompt_ids: Sequence[int]) -> ProbeResult:
        check_session_id(session_id)
        ids = check_prompt_ids(prompt_ids)
        t0 = time.monotonic()
        try:
            urls, how = self._targets(session_id)
        except Exception as e:  # noqa: BLE001 - a broken URL source is "unavailable", not a crash
            return unavailable(f"http probe: engine list failed: {e}", total_tokens=len(ids))
        if not urls:
            return self._combine([], how, len(ids), t0)
        client = self._sync_client()
        body = self._body(session_id, ids)
        # always through the pool: httpx timeouts are per phase/chunk, the pool wait bounds the whole call
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=16,
                                                                   thread_name_prefix="kvgate-http-probe")
            pool = self._pool
        futs = {u: pool.submit(self._ask_sync, client, u, body, len(ids)) for u in urls}
        done, _ = concurrent.futures.wait(futs.values(), timeout=self.timeout_s + 0.05)
        results = [(u, f.result() if f in done else "timeout") for u, f in futs.items()]
        return self._combine(results, how, len(ids), t0)

    # ------------------------------------------------------------------ async
    def _async_client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        entry = self._aclients.get(id(loop))
        if entry is None or entry[0] is not loop:
            for key, (other, _) in list(self._aclients.items()):
                if other.is_closed():  # a finished asyncio.run(): its client cannot be used any more
                    del self._aclients[key]
            entry = (loop, async_client(timeout=httpx.Timeout(self.timeout_s), headers=self.headers,
                                             limits=PROBE_LIMITS, trust_env=False))
            self._aclients[id(loop)] = entry
        return entry[1]

    async def _ask_async(self, client: httpx.AsyncClient, url: str, body: bytes, n: int) -> dict | str:
        deadline = time.monotonic() + self.timeout_s  # aprobe's wait bounds it too; see _ask_sync
        if isinstance(url, _BadUrl):
            return url.why
        try:
            async with client.stream("POST", url + self.path, content=body, headers=_JSON) as resp:
                _start(resp)
                chunks: list[bytes] = []
                got = 0
                async for chunk in resp.aiter_raw():
                    got = _add(chunks, got, chunk, deadline)
            return self._decode(url, b"".join(chunks), n)
        except httpx.TimeoutException:
            return "timeout"
        except (_Answer, ValueError) as e:
            return str(e)
        except Exception as e:  # noqa: BLE001 - httpx.InvalidURL, a client closed meanwhile: this engine only
            return f"{e.__class__.__name__}: {e}"

    async def aprobe(self, session_id: str, prompt_ids: Sequence[int]) -> ProbeResult:
        check_session_id(session_id)
        ids = check_prompt_ids(prompt_ids)
        t0 = time.monotonic()
        try:
            urls, how = await self._atargets(session_id)
        except Exception as e:  # noqa: BLE001
            return unavailable(f"http probe: engine list failed: {e}", total_tokens=len(ids))
        if not urls:
            return self._combine([], how, len(ids), t0)
        client = self._async_client()
        body = self._body(session_id, ids)
        tasks = [asyncio.ensure_future(self._ask_async(client, u, body, len(ids))) for u in urls]
        done, pending = await asyncio.wait(tasks, timeout=self.timeout_s + 0.05)
        for t in pending:
            t.cancel()
        results = [(u, t.result() if t in done else "timeout") for u, t in zip(urls, tasks)]
        return self._combine(results, how, len(ids), t0)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None

    async def aclose(self) -> None:
        loop = asyncio.get_running_loop()
        entry = self._aclients.pop(id(loop), None)
        if entry is not None:
            await entry[1].aclose()
        self.close()

    def __enter__(self) -> "HttpProbe":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    async def __aenter__(self) -> "HttpProbe":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()
