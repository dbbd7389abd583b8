"""The gate's metrics: the step metrics a trainer logs (drained once per step; a peek keeps
them) and the Prometheus collector, with what SPEC 7 asks to be exported: preemptions per
session, the window and epoch counters, the close counters (also for a reader whose own
config has the lifecycle off), the per-turn latencies. On fakeredis and a real redis-server."""
from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvgate.client.metrics import GateCollector

from _gatehelpers import engines, mkgate, script


def scrape(g) -> str:
    reg = CollectorRegistry()
    reg.register(GateCollector(g))
    return generate_latest(reg).decode()


def test_preemptions_per_session(backend, clock):
    g = mkgate(backend, clock, gate="mx")
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


def test_window_and_epoch_counters_reach_prometheus(backend, clock):
    g = mkgate(backend, clock, gate="mx", idle_grace_s=1.0)
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


def test_close_counters_reach_a_reader_without_the_lifecycle(backend, clock):
    # a driver reads the step with its own config; the workers closed sessions with the
    # lifecycle on. Before, the driver drained those counters without reporting them
    worker = mkgate(backend, clock, gate="mx", session_lifecycle=True, close_timeout_s=2.0,
                    engine_urls=("http://127.0.0.1:9",))  # nothing listens: one failed close
    worker.write_snapshot(engines(usage=0.1))
    out = worker.finish_session("s")
    assert out["close"] == {"attempts": 1, "failures": 1}
    driver = mkgate(backend, clock, gate="mx")
    m = driver.step_metrics()
    assert (m["agentic_kv/session/close"], m["agentic_kv/session/close_failure"]) == (1, 1)
    assert m["agentic_kv/session/lifecycle_enabled"] == 0
    assert "agentic_kv/session/close" not in driver.step_metrics()  # drained, nothing new


def test_the_preemption_figures_stay_bounded_with_many_unfinished_sessions(backend, clock):
    # sessions nobody finishes stay in the hash; a metrics read samples past 1,024 of them
    g = mkgate(backend, clock, gate="mx")
    g.write_snapshot(engines(usage=0.1))
    g.redis.hset(g.key("preempted"), mapping={f"s{i}": 3 for i in range(1500)})
    m = g.step_metrics(drain=False)
    assert m["agentic_kv/admission/preempted_sessions"] == 1500
    assert m["agentic_kv/admission/preempted_max_per_session"] == 3


# -- step metrics and the collector ------------------------------------------------------
def test_step_metrics_drain_and_names(backend, clock):
    g = mkgate(backend, clock, session_lifecycle=False)
    g.write_snapshot(engines(usage=0.2))
    g.write_snapshot(engines(usage=0.6))
    with g.turn("s", prompt_tokens=5, max_new_tokens=5, turn_index=3):
        pass
    m = g.step_metrics()
    assert m["agentic_kv/admission/admit"] == 1
    assert m["agentic_kv/admission/admit_open"] == 1
    assert m["agentic_kv/budget/kv_token_usage_mean"] == pytest.approx(0.4)
    assert m["agentic_kv/budget/kv_token_usage_max"] == pytest.approx(0.6)
    assert m["agentic_kv/budget/ceiling"] == 9000
    assert "agentic_kv/latency/turn_3_mean_s" in m
    script(g, "release", ticket="gone", latency_ms=1500.0, turn_index=7)  # no lease: not counted
    script(g, "acquire", ticket="t7", session="s7", need=10, prompt=5, protected=0, retain=0, probe=-2)
    script(g, "release", ticket="t7", latency_ms=1500.0, turn_index=7)
    script(g, "acquire", ticket="t8", session="s8", need=10, prompt=5, protected=0, retain=0, probe=-2)
    script(g, "release", ticket="t8", latency_ms=500.25, turn_index=7)
    assert g.step_metrics()["agentic_kv/latency/turn_7_mean_s"] == pytest.approx(1.000125)
    assert "agentic_kv/session/lifecycle_enabled" not in m
    m2 = g.step_metrics()
    assert m2["agentic_kv/admission/admit"] == 0  # drained once per step
    assert "agentic_kv/budget/kv_token_usage_mean" not in m2


def test_prometheus_collector(backend, clock):
    g = mkgate(backend, clock)
    g.write_snapshot(engines(usage=0.2))
    g.acquire("s", prompt_tokens=5, max_new_tokens=5).release()
    text = scrape(g)
    assert 'kvgate_admissions_total{gate="g1",reason="open"} 1.0' in text
    assert 'kvgate_up{gate="g1"} 1.0' in text


def test_a_peek_at_step_metrics_keeps_this_process_counts(backend):
    # pass-throughs are counted in this process (rule 1 touches no Redis): a dashboard's
    # peek (drain=False) must leave them for the step's real drain
    g = mkgate(backend, admission=False, residency=False)
    g.acquire("s", prompt_tokens=1, max_new_tokens=1).release()
    assert g.step_metrics(drain=False)["agentic_kv/admission/pass_through"] == 1
    assert g.step_metrics()["agentic_kv/admission/pass_through"] == 1
    assert g.step_metrics()["agentic_kv/admission/pass_through"] == 0


def test_a_release_with_a_null_turn_index_records_no_latency(backend, clock):
    g = mkgate(backend, clock, max_wait_s=30.0, headroom=1.0)
    g.write_snapshot(engines(usage=0.1, cap=1000))
    assert script(g, "acquire", ticket="A", session="a", need=10, probe=0.0, retain=0)["o"] == "admit"
    # a JSON null is an absent parameter: no turn index, so no per-turn-index sample
    assert script(g, "release", ticket="A", latency_ms=5.0, turn_index=None)["released"] == 1
    assert not [f for f in g.redis.hkeys(g.key("totals")) if f.startswith(b"lat_")]


def test_sharing_metrics(backend, clock):
    # two samples of one task: its 800-token prompt charged once, the second admitted at its own part
    g = mkgate(backend, clock, gate="mx")
    g.write_snapshot(engines(cap=10_000))
    for s in ("a", "b"):
        g.acquire(s, prompt_tokens=1000, max_new_tokens=100, prefix_key="task", prefix_tokens=800)
    m = g.step_metrics(drain=False)
    assert (m["agentic_kv/sharing/prefix_charged_tokens"], m["agentic_kv/sharing/group_admit"],
            m["agentic_kv/sharing/saved_tokens"]) == (800, 1, 800)
    assert m["agentic_kv/sharing/prefixes"] == 1
    assert (m["agentic_kv/budget/reserved"], m["agentic_kv/budget/reserved_unshared"]) == (1400, 2200)
    text = scrape(g)
    for line in ('kvgate_shared_prefixes{gate="mx"} 1.0', 'kvgate_reserved_unshared_tokens{gate="mx"} 2200.0',
                 'kvgate_group_admissions_total{gate="mx"} 1.0', 'kvgate_prefix_charged_tokens_total{gate="mx"} 800.0',
                 'kvgate_prefix_saved_tokens_total{gate="mx"} 800.0'):
        assert line in text
    assert g.step_metrics()["agentic_kv/sharing/group_admit"] == 1  # drained with the step
    assert g.step_metrics()["agentic_kv/sharing/group_admit"] == 0
