"""kvgate/control/budget_reading.py alone, against a real redis-server: the gate's counters and
the engines' cache counters become the BudgetController's readings."""
from __future__ import annotations

import asyncio

import pytest
import redis

import kvgate
from kvgate import keys
from kvgate.control.budget_reading import BudgetReader, engine_counters
from kvgate.control.call_threads import CallThreads
from kvgate.control.discovery import Endpoint
from kvgate.control.promparse import EngineMetrics, RankMetrics
from kvgate.control.scrape import ScrapeResult

pytestmark = pytest.mark.redis_real


def scrape(queries: float | None, hits: float | None, healthy: bool = True,
           prefill_s: float | None = None, queue_s: float | None = None) -> ScrapeResult:
    rank = RankMetrics(kind="vllm", dp_rank=None, capacity_tokens=10_000, prefix_cache_queries=queries,
                       prefix_cache_hits=hits, prefill_seconds=prefill_s, queue_seconds=queue_s)
    return ScrapeResult(Endpoint("http://10.0.0.1:8000", healthy=healthy),
                        metrics=EngineMetrics(kind="vllm", ranks=(rank,)))


def test_engine_counters_sum_the_healthy_engines():
    both = engine_counters([scrape(100, 40, prefill_s=2.0, queue_s=0.5),
                            scrape(50, 10, prefill_s=1.5, queue_s=0.25)])
    assert both == {"queries": 150, "hits": 50, "prefill_s": 3.5, "queue_s": 0.75, "engines": 2,
                    "capacity": 20_000}
    # one engine does not export its cache counters, its prefill or its queue time: that sum is unknown
    assert engine_counters([scrape(100, 40), scrape(None, None)])["queries"] is None
    assert engine_counters([scrape(100, 40, prefill_s=2.0), scrape(50, 10)])["prefill_s"] is None
    assert engine_counters([scrape(100, 40, queue_s=1.0), scrape(50, 10)])["queue_s"] is None
    failed = ScrapeResult(Endpoint("http://10.0.0.2:8000"), error="timed out")
    assert engine_counters([scrape(100, 40), failed]) is None  # not comparable this tick
    sick = ScrapeResult(Endpoint("http://10.0.0.2:8000", healthy=False), error="router reports ...")
    assert engine_counters([scrape(100, 40), sick]) == {"queries": 100, "hits": 40, "prefill_s": None,
                                                        "queue_s": None, "engines": 1, "capacity": 10_000}


@pytest.fixture
def client(redis_url):
    c = redis.Redis.from_url(redis_url, socket_timeout=2.0)
    yield c
    c.close()


def ledger(client, **fields) -> None:
    client.hset(keys.key("bg", "ledger"), mapping=fields)


def test_a_fixed_scale_or_no_admission_measures_nothing(client):
    for cfg in (kvgate.GateConfig(budget_scale=2.0), kvgate.GateConfig(admission=False)):
        r = BudgetReader(client, "bg", cfg, CallThreads(bound_s=2.0))
        assert not r.measures and asyncio.run(r.measure([scrape(100, 40)])) is None


def test_readings_grow_the_scale_from_the_published_one_and_an_epoch_resets_it(client):
    r = BudgetReader(client, "bg", kvgate.GateConfig(), CallThreads(bound_s=2.0))
    client.hset(keys.key("bg", "snapshot"), "budget_scale", "2.0")
    ledger(client, epoch=1)
    assert asyncio.run(r.measure([scrape(0, 0)])) == 2.0  # no script ran yet: the published scale
    ledger(client, acc_ts=1000, acc_wait_ms=0, acc_idle_ms=0, n_released=0, tok_fresh=0, tok_reusable=0)
    assert asyncio.run(r.measure([scrape(0, 0)])) == 2.0  # the window's start
    # 8 releases (MIN_RELEASES) over 10 s, 1 s of it idle with turns waiting: grows to carry it, x 1 / 0.9
    ledger(client, acc_ts=11_000, acc_wait_ms=5_000, acc_idle_ms=1_000, n_released=8)
    assert asyncio.run(r.measure([scrape(100, 100)])) == pytest.approx(2.0 / 0.9)
    failed = ScrapeResult(Endpoint("http://10.0.0.2:8000"), error="timed out")
    ledger(client, acc_ts=21_000, acc_idle_ms=9_000, n_released=16)
    assert asyncio.run(r.measure([scrape(100, 100), failed])) == pytest.approx(2.0 / 0.9)  # not read
    ledger(client, epoch=2)
    assert asyncio.run(r.measure([scrape(200, 200)])) == 1.0  # other engines: start over from the ledger
    assert r.controller.startup  # nothing measured of them yet
    r.new_term()
    assert asyncio.run(r.measure([scrape(200, 200)])) == 2.0  # a new term: the scale the gate publishes
    assert not r.controller.startup  # the scale another leader measured: no startup from there


def test_a_gate_with_no_published_scale_starts_in_startup(client):
    r = BudgetReader(client, "bs", kvgate.GateConfig(), CallThreads(bound_s=2.0))
    client.hset(keys.key("bs", "ledger"), mapping={"epoch": 1, "acc_ts": 1000, "acc_wait_ms": 0, "acc_idle_ms": 0,
                                                    "n_released": 0, "tok_fresh": 0, "tok_reusable": 0})
    assert asyncio.run(r.measure([scrape(0, 0)])) == 1.0 and r.controller.startup
    # 8 releases over 10 s, 1 s of it idle with turns waiting: doubles, where rule 1 alone grows x 1 / 0.9
    client.hset(keys.key("bs", "ledger"), mapping={"acc_ts": 11_000, "acc_wait_ms": 5_000, "acc_idle_ms": 1_000,
                                                    "n_released": 8})
    assert asyncio.run(r.measure([scrape(100, 100)])) == pytest.approx(2.0)
