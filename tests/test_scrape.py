"""kvgate/control/scrape.py alone: one ScrapeResult per endpoint, against loopback servers."""
from __future__ import annotations

import asyncio

import httpx

from kvgate.control.discovery import Endpoint
from kvgate.control.scrape import scrape_engines
from _httphelpers import FakeHTTP, RefusedPort, html, sglang_metrics, text


def test_one_result_per_endpoint_in_order_and_the_router_s_verdict_is_not_asked():
    good, bad, sick = FakeHTTP().start(), FakeHTTP().start(), FakeHTTP().start()
    good.route("GET", "/metrics", text(sglang_metrics(10_000, 2_000)))
    bad.route("GET", "/metrics", html(502))
    sick.route("GET", "/metrics", text(sglang_metrics(10_000, 2_000)))
    try:
        with RefusedPort() as gone:
            eps = [Endpoint(good.url), Endpoint(bad.url), Endpoint(sick.url, healthy=False, draining=True),
                   Endpoint(gone.url)]

            async def main():
                async with httpx.AsyncClient(trust_env=False) as client:
                    return await scrape_engines(client, eps, concurrency=2, timeout_s=5.0,
                                                max_body_bytes=1 << 20)

            res = asyncio.run(main())
        assert [r.endpoint.url for r in res] == [e.url for e in eps]
        assert res[0].metrics.ranks[0].capacity_tokens == 10_000 and res[0].error is None
        assert res[1].metrics is None and res[1].error
        assert res[2].error == "router reports the worker unhealthy (draining)" and not sick.requests
        assert res[3].metrics is None and res[3].error
    finally:
        for s in (good, bad, sick):
            s.stop()
