"""What SPEC 7 asks to be exported and was missing: num_preempted per session (seed 000) in
the step metrics and Prometheus, the window and epoch counters in Prometheus, and the close
counters for a reader whose own config has the lifecycle off."""
from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

import kvgate
from kvgate.client.metrics import GateCollector

from _gatehelpers import Clock, engines, script

FAST = dict(wait_poll_s=0.2, max_wait_s=2.0, staleness_s=6.0)


def mkgate(backend, clock, **cfg):
    return kvgate.Gate(backend(), gate="mx", config=kvgate.GateConfig(**{**FAST, **cfg}), clock_ms=clock)


def scrape(g) -> str:
    reg = CollectorRegistry()
    reg.register(GateCollector(g))
    return generate_latest(reg).decode()


def test_preemptions_per_session(backend):
    clock = Clock()
    g = mkgate(backend, clock)
    g.write_snapshot(engines(usage=0.95))  # above the guard: attempts wait
    for t in ("s1", "s2", "s3"):  # session s: two attempts preempted
        assert script(g, "acquire", ticket=t, session="s", need=10, probe=0.0)["o"] == "wait"
        clock.advance(0.05)
    for t in ("u1", "u2"):  # session u: one
        assert script(g, "acquire", ticket=t, session="u", need=10, probe=0.0)["o"] == "wait"
        clock.advance(0.05)
    m = g.step_metrics(drain=False)
    assert m["agentic_kv/admission/preempted_sessions"] == 2
    assert m["agentic_kv/admission/preempted_max_per_session"] == 2
    text = scrape(g)
    assert 'kvgate_preempted_sessions{gate="mx"} 2.0' in text
    assert 'kvgate_preempted_max_per_session{gate="mx"} 2.0' in text
    g.finish_session("s")  # a finished session is forgotten
    m = g.step_metrics()
    assert (m["agentic_kv/admission/preempted_sessions"], m["agentic_kv/admission/preempted_max_per_session"]) == (1, 1)


def test_window_and_epoch_counters_reach_prometheus(backend):
    clock = Clock()
    g = mkgate(backend, clock, idle_grace_s=1.0)
    g.write_snapshot(engines(usage=0.1))
    g.acquire("s", prompt_tokens=100, max_new_tokens=10).release()  # its window idles
    assert g.redis.hexists(g.key("windows"), "s")
    clock.advance(2.0)
    g.housekeep()
    assert not g.redis.hexists(g.key("windows"), "s")
    g.write_snapshot(engines(usage=0.1, n=2))  # the healthy set changed: one bump
    text = scrape(g)
    assert 'kvgate_window_expired_total{gate="mx"} 1.0' in text
    assert 'kvgate_epoch_bumps_total{gate="mx"} 1.0' in text
    assert 'kvgate_window_revoked_total{gate="mx"} 0.0' in text
    assert 'kvgate_window_yielded_total{gate="mx"} 0.0' in text


def test_close_counters_reach_a_reader_without_the_lifecycle(backend):
    # a driver reads the step with its own config; the workers closed sessions with the
    # lifecycle on. Before, the driver drained those counters without reporting them
    clock = Clock()
    worker = mkgate(backend, clock, session_lifecycle=True, close_timeout_s=2.0,
                    engine_urls=("http://127.0.0.1:9",))  # nothing listens: one failed close
    worker.write_snapshot(engines(usage=0.1))
    out = worker.finish_session("s")
    assert out["close"] == {"attempts": 1, "failures": 1}
    driver = mkgate(backend, clock)
    m = driver.step_metrics()
    assert (m["agentic_kv/session/close"], m["agentic_kv/session/close_failure"]) == (1, 1)
    assert m["agentic_kv/session/lifecycle_enabled"] == 0
    assert "agentic_kv/session/close" not in driver.step_metrics()  # drained, nothing new


def test_the_preemption_figures_stay_bounded_with_many_unfinished_sessions(backend):
    # sessions nobody finishes stay in the hash; a metrics read samples past 1,024 of them
    clock = Clock()
    g = mkgate(backend, clock)
    g.write_snapshot(engines(usage=0.1))
    g.redis.hset(g.key("preempted"), mapping={f"s{i}": 3 for i in range(1500)})
    m = g.step_metrics(drain=False)
    assert m["agentic_kv/admission/preempted_sessions"] == 1500
    assert m["agentic_kv/admission/preempted_max_per_session"] == 3
