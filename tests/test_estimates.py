"""kvgate/control/estimates.py alone: scrapes in, engine states out (no I/O)."""
from __future__ import annotations

import pytest

from kvgate.control.discovery import Endpoint
from kvgate.control.estimates import EngineEstimates
from kvgate.control.promparse import parse_metrics
from kvgate.control.scrape import ScrapeResult
from _httphelpers import read_data, sglang_metrics

URL = "http://10.0.0.1:30000"


def ok(used: int, url: str = URL) -> ScrapeResult:
    return ScrapeResult(Endpoint(url), metrics=parse_metrics(sglang_metrics(10_000, used)))


def failed(url: str = URL, healthy: bool = True) -> ScrapeResult:
    return ScrapeResult(Endpoint(url, healthy=healthy), error="timed out")


def test_a_failed_scrape_is_bridged_until_unhealthy_after_in_a_row():
    est = EngineEstimates(unhealthy_after=2)
    assert est.states([ok(100)])[0].used_tokens == 100
    st = est.states([failed()])[0]
    assert st.healthy and st.used_tokens == 100 and est.scrapes_bridged == 1  # its last numbers
    assert est.states([ok(200)])[0].used_tokens == 200  # a success resets the count
    assert est.states([failed()])[0].healthy
    st = est.states([failed()])[0]
    assert not st.healthy and st.capacity_tokens == 0 and est.scrapes_bridged == 2
    assert not est.states([failed()])[0].healthy  # only a fresh scrape brings it back


def test_what_is_not_bridged():
    est = EngineEstimates(unhealthy_after=2)
    assert not est.states([failed()])[0].healthy  # never scraped successfully
    est.states([ok(100)])
    assert not est.states([failed(healthy=False)])[0].healthy  # the router's own verdict
    est.states([ok(100)])
    est.forget()  # a new leader term: the last numbers are not fresh
    assert not est.states([failed()])[0].healthy
    est.states([ok(100)])
    est.states([ok(100, url="http://10.0.0.2:30000")])  # URL left the list: its numbers are dropped
    assert not est.states([failed()])[0].healthy


def test_interval_hit_rate_from_vllm_counters():
    body = read_data("vllm_single_metrics.txt")
    est = EngineEstimates(unhealthy_after=2)

    def scrape(text: str) -> ScrapeResult:
        return ScrapeResult(Endpoint(URL, worker_type="vllm"), metrics=parse_metrics(text))

    assert est.states([scrape(body)])[0].hit_rate == pytest.approx(138240 / 184320)
    more = body.replace("138240.0", "138340.0").replace("184320.0", "184720.0")
    assert est.states([scrape(more)])[0].hit_rate == pytest.approx(100 / 400)
    assert est.states([failed()])[0].hit_rate == pytest.approx(100 / 400)  # bridged: the last rate
