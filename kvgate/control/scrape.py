"""Scraping the engines: each endpoint discovery listed, its ``/metrics`` fetched and parsed.

One ``ScrapeResult`` per endpoint, in discovery's order: the parsed metrics, or why there are
none (the router calls the worker unhealthy or draining, so it is not asked; no answer in
time, a body past the cap, garbage).  Requests run concurrently, at most ``concurrency`` at
a time, each with the bounds of kvgate/control/discovery.py's ``fetch_limited``.  A failed
scrape never raises: what it means for the engine's health is kvgate/control/estimates.py's.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Sequence

import httpx

from kvgate.control.discovery import Endpoint, HttpError, fetch_limited
from kvgate.control.promparse import EngineMetrics, MetricsParseError, parse_metrics

__all__ = ["ScrapeResult", "scrape_engines"]


@dataclass
class ScrapeResult:
    endpoint: Endpoint
    metrics: EngineMetrics | None = None
    error: str | None = None
    seconds: float = 0.0


async def scrape_engines(client: httpx.AsyncClient, endpoints: Sequence[Endpoint], *, concurrency: int,
                         timeout_s: float, max_body_bytes: int) -> list[ScrapeResult]:
    sem = asyncio.Semaphore(concurrency)
    return list(await asyncio.gather(*(_scrape(client, sem, ep, timeout_s, max_body_bytes)
                                       for ep in endpoints)))


async def _scrape(client: httpx.AsyncClient, sem: asyncio.Semaphore, ep: Endpoint, timeout_s: float,
                  max_body_bytes: int) -> ScrapeResult:
    if not ep.healthy:
        return ScrapeResult(ep, error="router reports the worker unhealthy" +
                            (" (draining)" if ep.draining else ""))
    t0 = time.monotonic()
    async with sem:
        try:
            body = await fetch_limited(client, ep.url + "/metrics", timeout_s=timeout_s,
                                       max_body_bytes=max_body_bytes)
            text = body.decode("utf-8", errors="replace")
            m = parse_metrics(text)
        except (HttpError, MetricsParseError) as e:
            return ScrapeResult(ep, error=str(e), seconds=time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001 - a bad engine never kills the poller
            return ScrapeResult(ep, error=f"{type(e).__name__}: {e}", seconds=time.monotonic() - t0)
    return ScrapeResult(ep, metrics=m, seconds=time.monotonic() - t0)
