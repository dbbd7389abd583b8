"""Session KV lifecycle for SGLang (SPEC section 4, seed 003).

* :func:`with_session_id` tags a ``/generate`` payload with a top-level ``session_id`` so
  SGLang's session radix cache attributes the turn's KV to the session.
* :func:`aclose_session` / :func:`close_session` send an idempotent
  ``POST /close_session {"session_id": ...}`` to every engine base URL directly and
  concurrently (the router does not proxy it; SGLang's DP controller broadcasts it to its DP
  ranks, ranks without the session no-op).  Failures are counted in the returned
  :class:`CloseResult` and never raised: closing is a KV-release optimisation, the session
  ends regardless.
"""
from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import httpx

from kvgate._http import async_client
from kvgate.control.discovery import HttpError, dedupe_urls, fetch_limited

from .flows import check_session_id

__all__ = ["CloseResult", "with_session_id", "aclose_session", "close_session"]

_CLOSE_BODY_LIMIT = 64 * 1024  # /close_session answers with an empty body


@dataclass(frozen=True)
class CloseResult:
    """Outcome of one close fan-out: one attempt per engine base URL."""

    attempts: int
    failures: int
    errors: tuple[str, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return self.failures == 0


def with_session_id(payload: Mapping, session_id: str) -> dict:
    """A copy of a ``/generate`` payload with a top-level ``session_id``; the input is untouched.

    Raises ValueError on a session id the gate would refuse (``flows.check_session_id``), a
    non-mapping payload, or a payload already carrying a different ``session_id``.
    """
    sid = check_session_id(session_id)
    if not isinstance(payload, Mapping):
        raise ValueError(f"payload must be a mapping, got {type(payload).__name__}")
    prev = payload.get("session_id")
    if prev not in (None, sid):
        raise ValueError(f"payload already carries session_id={prev!r}, not {sid!r}")
    out = dict(payload)
    out["session_id"] = sid
    return out


def _check_knobs(timeout_s: float, concurrency: int) -> None:
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    if not (isinstance(concurrency, int) and concurrency > 0):
        raise ValueError(f"concurrency must be a positive int, got {concurrency!r}")


async def aclose_session(
    urls: Iterable[str],
    session_id: str,
    *,
    timeout_s: float = 2.0,
    concurrency: int = 16,
    client: httpx.AsyncClient | None = None,
) -> CloseResult:
    """POST ``/close_session`` to every distinct engine base URL, at most ``concurrency`` at
    a time, each bounded by ``timeout_s``.  Returns counts; never raises for engine faults.

    Bad arguments (empty session id, malformed URL) raise ValueError before any request.
    """
    sid = check_session_id(session_id)
    _check_knobs(timeout_s, concurrency)
    bases = dedupe_urls(urls)
    if not bases:
        return CloseResult(0, 0)
    sem = asyncio.Semaphore(concurrency)

    async def one(c: httpx.AsyncClient, base: str) -> str | None:
        async with sem:
            try:
                await fetch_limited(c, base + "/close_session", timeout_s=timeout_s,
                                    max_body_bytes=_CLOSE_BODY_LIMIT, method="POST",
                                    json_body={"session_id": sid})
            except HttpError as e:
                return str(e)
            except Exception as e:  # noqa: BLE001 - a close must never raise into the agent loop
                return f"{base}/close_session: {type(e).__name__}: {e}"
            return None

    async def run(c: httpx.AsyncClient) -> list[str | None]:
        return await asyncio.gather(*(one(c, b) for b in bases))

    if client is not None:
        outcomes = await run(client)
    else:
        async with async_client(trust_env=False) as c:
            outcomes = await run(c)
    errors = tuple(e for e in outcomes if e is not None)
    return CloseResult(attempts=len(bases), failures=len(errors), errors=errors)


def close_session(
    urls: Iterable[str],
    session_id: str,
    *,
    timeout_s: float = 2.0,
    concurrency: int = 16,
) -> CloseResult:
    """Synchronous :func:`aclose_session`: runs it on its own event loop in a helper thread,
    so it is callable from any thread, with or without a running loop, and returns within
    ``timeout_s`` per batch of ``concurrency`` URLs plus 5 s whatever the engines or the
    resolver do (a close that has not answered by then counts as failed everywhere)."""
    check_session_id(session_id)
    _check_knobs(timeout_s, concurrency)
    urls = dedupe_urls(urls)  # ValueError on a malformed URL, before any request
    coro_args = dict(timeout_s=timeout_s, concurrency=concurrency)
    # Always on a helper thread that is never joined past the bound: asyncio.run ends by
    # joining its default executor, where a name lookup that hangs (loop.getaddrinfo) keeps
    # running after the request's own deadline cancelled it, so neither the caller's thread
    # nor a running event loop (a sync Gate used in async code) may run or join that loop.
    # Bounded: every request inside has its own deadline; add slack for scheduling.
    batches = max(1, -(-len(urls) // concurrency))
    bound = timeout_s * batches + 5.0
    box: dict[str, object] = {}

    def target() -> None:
        try:
            box["result"] = asyncio.run(aclose_session(urls, session_id, **coro_args))
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread below
            box["error"] = e

    t = threading.Thread(target=target, name="kvgate-close", daemon=True)
    t.start()
    t.join(bound)
    if "result" in box:
        return box["result"]  # type: ignore[return-value]
    why = (f"{type(box['error']).__name__}: {box['error']}" if "error" in box
           else f"no answer within {bound:g} s")
    return CloseResult(len(urls), len(urls), (f"close fan-out failed: {why}",))
