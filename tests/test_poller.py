"""The poller against a real redis-server and real loopback HTTP engines / routers."""
from __future__ import annotations

import os
import threading
import time

import pytest

import kvgate
from kvgate.control.poller import Poller, leader_key
from _httphelpers import (
    FakeHTTP,
    hang,
    html,
    huge,
    js,
    read_data,
    sglang_metrics,
    text,
    wait_until,
)

pytestmark = pytest.mark.redis_real


@pytest.fixture
def servers():
    made: list[FakeHTTP] = []

    def make(metrics: str | None = None) -> FakeHTTP:
        s = FakeHTTP().start()
        if metrics is not None:
            s.route("GET", "/metrics", text(metrics))
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()


def make_gate(url: str, name: str = "pg", **knobs) -> kvgate.Gate:
    return kvgate.Gate.from_url(url, gate=name, config=kvgate.GateConfig(**knobs))


def by_id(status: dict) -> dict:
    return {e["id"]: e for e in status["engines"]}


def test_tick_writes_sum_of_capacity_and_worst_usage(redis_url, servers):
    e1 = servers(sglang_metrics(10_000, 2_000, tp=2))
    e2 = servers(sglang_metrics(20_000, 15_000))
    gate = make_gate(redis_url)
    p = Poller(gate, engines=[e1.url, e2.url])
    r = p.tick()
    assert r.leader and r.wrote and not r.errors
    assert r.snapshot.capacity_tokens == 30_000  # tp=2 folded by max, not 2 x 10k
    assert r.snapshot.usage == pytest.approx(0.75)
    st = gate.status()
    assert not st["degraded"] and st["capacity"] == 30_000
    assert by_id(st)[e1.url]["cap"] == 10_000 and by_id(st)[e1.url]["healthy"] == 1
    # the leader housekeeps every tick (nothing to reclaim on a fresh gate; tests/test_purge_wakes.py
    # shows a tick's housekeeping purging an expired window and granting the waiter behind it)
    assert r.housekeep == {"leases": 0, "windows": 0, "waiters": 0, "revoked": 0, "granted": 0}


def test_bad_engines_are_unhealthy_for_the_round(redis_url, servers):
    good = servers(sglang_metrics(8_000, 800))
    hung = servers()
    hung.route("GET", "/metrics", hang(30))
    page = servers()
    page.route("GET", "/metrics", html(200))
    big = servers()
    big.route("GET", "/metrics", huge(20_000_000))
    gone = servers()
    gone.stop()
    gate = make_gate(redis_url)
    p = Poller(gate, engines=[good.url, hung.url, page.url, big.url, gone.url], http_timeout_s=0.5,
               max_body_bytes=256 * 1024)
    t0 = time.monotonic()
    r = p.tick()
    assert time.monotonic() - t0 < 10  # bounded, not a timing claim about speed
    print(f"\nhung, garbage, huge and dead engines: the tick took {time.monotonic() - t0:.2f} s (http_timeout_s=0.5)")
    assert r.wrote
    health = {s.engine_id: s.healthy for s in r.states}
    assert health == {good.url: True, hung.url: False, page.url: False, big.url: False, gone.url: False}
    assert "timed out" in r.errors[hung.url]
    assert "not Prometheus" in r.errors[page.url]
    assert "exceeds" in r.errors[big.url]
    assert r.snapshot.capacity_tokens == 8_000 and r.snapshot.n_healthy == 1


def test_router_unhealthy_worker_is_not_scraped(redis_url, servers):
    ok = servers(sglang_metrics(5_000, 1_000))
    sick = servers(sglang_metrics(5_000, 4_900))
    router = servers()
    router.route("GET", "/workers", js({"workers": [
        {"id": "a", "url": ok.url, "model_id": "m", "worker_type": "regular", "is_healthy": True, "load": 0},
        {"id": "b", "url": sick.url, "model_id": "m", "worker_type": "regular", "is_healthy": False, "load": 0},
    ], "total": 2, "stats": {}}))
    gate = make_gate(redis_url)
    r = Poller(gate, router=router.url).tick()
    assert r.wrote and r.snapshot.n_healthy == 1 and r.snapshot.usage == pytest.approx(0.2)
    assert {s.engine_id: s.healthy for s in r.states} == {ok.url: True, sick.url: False}
    assert not sick.requests  # the poller trusted the router and did not scrape it


def test_router_with_only_list_workers(redis_url, servers):
    e = servers(read_data("sglang_single_metrics.txt"))
    router = servers()
    router.route("GET", "/list_workers", js({"urls": [e.url]}))
    gate = make_gate(redis_url)
    p = Poller(gate, router=router.url)
    r = p.tick()
    assert r.wrote and r.snapshot.capacity_tokens == 838_860
    assert p.discovery.last_source == "list_workers"


def test_dp_engine_becomes_one_state_per_rank(redis_url, servers):
    e = servers(read_data("sglang_dp_metrics.txt"))
    gate = make_gate(redis_url)
    r = Poller(gate, engines=[e.url]).tick()
    ids = [s.engine_id for s in r.states]
    assert ids == [f"{e.url}#dp0", f"{e.url}#dp1"]
    assert r.snapshot.capacity_tokens == 2 * 838_860 and r.snapshot.usage == pytest.approx(0.95)
    assert gate.engine_urls() == [e.url]  # one base URL for /close_session


def test_vllm_engine_and_interval_hit_rate(redis_url, servers):
    body = read_data("vllm_single_metrics.txt")
    e = servers(body)
    gate = make_gate(redis_url)
    p = Poller(gate, engines=[e.url])
    r = p.tick()
    assert r.states[0].kind == "vllm" and r.states[0].capacity_tokens == 2048 * 16
    assert r.states[0].hit_rate == pytest.approx(138240 / 184320)  # cumulative on first sight
    e.route("GET", "/metrics", text(body.replace("138240.0", "138340.0").replace("184320.0", "184720.0")))
    r = p.tick()
    assert r.states[0].hit_rate == pytest.approx(100 / 400)  # delta of the counters


def with_prefill(body: str, seconds: float, tokens: float) -> str:
    """vLLM's two per-request histogram sums the poller reads for the prefill cost."""
    labels = '{engine="0",model_name="m"}'
    return (body + f"vllm:request_prefill_time_seconds_sum{labels} {seconds}\n"
            f"vllm:request_prefill_kv_computed_tokens_sum{labels} {tokens}\n")


def test_vllm_prefill_cost_per_uncached_token(redis_url, servers, monkeypatch):
    import kvgate.control.estimates

    monkeypatch.setattr(kvgate.control.estimates, "PREFILL_LOAD_WINDOW_S", 0.0)  # a load from every interval
    body = read_data("vllm_single_metrics.txt")
    e = servers(with_prefill(body, 2.0, 10_000))
    gate = make_gate(redis_url)
    p = Poller(gate, engines=[e.url])
    t0 = time.monotonic()
    r = p.tick()
    t1 = time.monotonic()
    assert r.states[0].prefill_s_per_token == pytest.approx(2e-4)  # cumulative on first sight
    assert r.states[0].prefill_load is None  # a load needs an interval
    assert p.prefill_load_pending  # what the bench waits out before a gate policy starts
    assert gate.status()["prefill_s_per_token"] == pytest.approx(2e-4)
    e.route("GET", "/metrics", text(with_prefill(body, 2.4, 11_000)))  # this interval: 4e-4
    t2 = time.monotonic()
    r = p.tick()
    t3 = time.monotonic()
    assert r.states[0].prefill_s_per_token == pytest.approx(3e-4)  # half old, half new
    # 0.4 s of prefill over the wall time between the two scrapes
    assert 0.4 / (t3 - t0) <= r.states[0].prefill_load <= 0.4 / (t2 - t1)
    assert gate.status()["prefill_load"] == pytest.approx(r.states[0].prefill_load)
    assert not p.prefill_load_pending
    e.route("GET", "/metrics", text(with_prefill(body, 2.5, 11_100)))  # 100 tokens: too few to measure
    assert p.tick().states[0].prefill_s_per_token == pytest.approx(3e-4)
    e.route("GET", "/metrics", text(with_prefill(body, 3.5, 11_300)))  # 300 more since the last update
    assert p.tick().states[0].prefill_s_per_token == pytest.approx(0.5 * 3e-4 + 0.5 * (1.1 / 300))
    e.route("GET", "/metrics", text(with_prefill(body, 0.1, 1_000)))  # restarted engine: start over
    assert p.tick().states[0].prefill_s_per_token == pytest.approx(1e-4)
    assert p.prefill_load_pending
    e.route("GET", "/metrics", text(body))  # no histograms: no estimate, and none in Redis
    st = p.tick().states[0]
    assert (st.prefill_s_per_token, st.prefill_load) == (None, None)
    assert (gate.status()["prefill_s_per_token"], gate.status()["prefill_load"]) == (None, None)
    assert not p.prefill_load_pending  # nothing to wait for where no engine exports prefill time


def test_bench_starts_gate_policies_with_the_prefill_load_measured(redis_url, servers, monkeypatch):
    # a deployed poller runs all along; the bench's poller ticks until its first load window
    # closes before a gate policy's first turn, so the step does not start with the load
    # unmeasured (the simulator, exporting no prefill time, starts at once)
    import asyncio
    from types import SimpleNamespace

    import kvgate.control.estimates
    import kvgate.control.poller
    from kvgate.tools.bench.runner import _start_poller, _stop_poller

    body = read_data("vllm_single_metrics.txt")

    def window(seconds: float) -> None:
        # the estimates measure over it; the bench reads it through kvgate.control.poller
        for module in (kvgate.control.estimates, kvgate.control.poller):
            monkeypatch.setattr(module, "PREFILL_LOAD_WINDOW_S", seconds)

    async def start(url: str) -> tuple[float, dict]:
        t0 = time.monotonic()
        h = await _start_poller(redis_url, "bench-warm", kvgate.GateConfig(), SimpleNamespace(engine_urls=[url]), 0.1)
        waited = time.monotonic() - t0
        status = h.gate.status()
        await _stop_poller(h)
        return waited, status

    window(0.3)
    waited, st = asyncio.run(start(servers(with_prefill(body, 2.0, 10_000)).url))
    assert waited >= 0.3 and st["prefill_load"] == 0.0  # an idle engine: measured, not unknown
    # an engine without prefill time has no window to wait out: with a 60 s window the start
    # is still prompt (the bound tells "did not wait for the window" from "waited 60 s", it
    # claims nothing about speed)
    window(60.0)
    waited, st = asyncio.run(start(servers(body).url))
    assert waited < 30.0 and st["prefill_load"] is None


def test_prefill_load_waits_for_a_whole_window(redis_url, servers, monkeypatch):
    import kvgate.control.estimates

    # a window far longer than two ticks on any box, so the claim is checked on every run
    monkeypatch.setattr(kvgate.control.estimates, "PREFILL_LOAD_WINDOW_S", 600.0)
    body = read_data("vllm_single_metrics.txt")
    e = servers(with_prefill(body, 2.0, 10_000))
    p = Poller(make_gate(redis_url), engines=[e.url])
    p.tick()
    e.route("GET", "/metrics", text(with_prefill(body, 2.4, 11_000)))
    st = p.tick().states[0]
    assert st.prefill_s_per_token == pytest.approx(3e-4)  # the cost needs no window
    assert st.prefill_load is None  # the window has not closed: no load yet
    assert p.prefill_load_pending


def test_sglang_engine_has_no_prefill_cost(redis_url, servers):
    e = servers(sglang_metrics(10_000, 2_000))
    p = Poller(make_gate(redis_url), engines=[e.url])
    assert p.tick().states[0].prefill_s_per_token is None


def test_epoch_bumps_only_when_healthy_set_changes(redis_url, servers):
    e1 = servers(sglang_metrics(10_000, 100))
    e2 = servers(sglang_metrics(10_000, 100))
    gate = make_gate(redis_url)
    p = Poller(gate, engines=[e1.url, e2.url])
    first = p.tick().snapshot
    again = p.tick().snapshot
    assert not again.bumped and again.epoch == first.epoch
    e2.route("GET", "/metrics", html(502))
    blip = p.tick()  # one failed scrape: e2's last numbers stand in (unhealthy_after=2)
    assert blip.errors[e2.url] and not blip.snapshot.bumped and blip.snapshot.n_healthy == 2
    down = p.tick().snapshot  # the second in a row: unhealthy, the healthy set changed
    assert down.bumped and down.epoch > first.epoch and down.n_healthy == 1
    assert not p.tick().snapshot.bumped
    e2.route("GET", "/metrics", text(sglang_metrics(10_000, 100)))
    up = p.tick().snapshot
    assert up.bumped and up.epoch > down.epoch and up.n_healthy == 2
    assert gate.status()["epoch"] == up.epoch


def test_no_snapshot_when_router_unreachable_and_an_empty_one_when_all_engines_down(redis_url, servers):
    e = servers(sglang_metrics(10_000, 100))
    router = servers()
    router.route("GET", "/workers", js({"workers": [{"url": e.url, "is_healthy": True}]}))
    gate = make_gate(redis_url)
    p = Poller(gate, router=router.url, http_timeout_s=0.5)
    assert p.tick().wrote
    ts = gate.redis.hget(gate.key("snapshot"), "ts_ms")
    router.route("GET", "/workers", html(502))
    r = p.tick()
    assert not r.wrote and r.reason == "router_unreachable" and r.discovery_error
    assert gate.redis.hget(gate.key("snapshot"), "ts_ms") == ts  # nothing known: nothing written
    router.route("GET", "/workers", js({"workers": [{"url": e.url, "is_healthy": True}]}))
    e.route("GET", "/metrics", html(500))
    assert p.tick().wrote  # its first failed scrape: the last numbers stand in
    # the second in a row: no engine is healthy. That is written (the healthy set changed: the
    # epoch bumps), and a snapshot without a healthy engine reads as not fresh: clients degrade
    r = p.tick()
    assert r.wrote and r.reason == "no_healthy_engine"
    assert r.snapshot.n_healthy == 0 and r.snapshot.capacity_tokens == 0 and r.snapshot.bumped
    assert gate.status()["degraded"]


def test_only_the_leader_writes_and_standby_takes_over(redis_url, servers):
    e = servers(sglang_metrics(10_000, 100))
    a = Poller(make_gate(redis_url), engines=[e.url], leader_ttl_s=2.0, identity="A")
    b = Poller(make_gate(redis_url), engines=[e.url], leader_ttl_s=2.0, identity="B")
    assert a.tick().leader
    rb = b.tick()
    assert not rb.leader and not rb.wrote and rb.reason == "standby"
    assert a.leader_identity() == "A"
    assert a.tick().wrote  # extends its lease
    a.release()  # graceful shutdown hands over at once
    assert b.tick().wrote and b.leader_identity() == "B"
    assert not a.tick().leader


def test_run_loop_stops_and_releases(redis_url, servers):
    e = servers(sglang_metrics(10_000, 100))
    gate = make_gate(redis_url)
    p = Poller(gate, engines=[e.url], interval_s=0.05, leader_ttl_s=1.0)
    th = threading.Thread(target=p.run, daemon=True)
    th.start()
    wait_until(lambda: p.writes >= 3, timeout=10)
    p.stop()
    th.join(timeout=10)
    assert not th.is_alive()
    assert gate.redis.get(leader_key("pg")) is None


def test_clients_degrade_when_pollers_stop_and_recover(redis_url, servers):
    e = servers(sglang_metrics(100_000, 100))
    gate = make_gate(redis_url, staleness_s=0.6)
    p = Poller(gate, engines=[e.url], interval_s=0.1, leader_ttl_s=1.0)
    th = threading.Thread(target=p.run, daemon=True)
    th.start()
    try:
        wait_until(lambda: p.writes >= 1, timeout=10)
        lease = gate.acquire("s1", prompt_tokens=100, max_new_tokens=10)
        assert (lease.outcome, lease.reason) == ("admit", "open")
        lease.release()
    finally:
        p.stop()
        th.join(timeout=10)
    t_stop = time.monotonic()

    def degraded():
        lz = gate.acquire("s2", prompt_tokens=100, max_new_tokens=10)
        lz.release()
        return lz.outcome == "bypass" and lz.reason == "degraded"

    wait_until(degraded, timeout=10, interval=0.1)
    assert gate.status()["degraded"]
    print(f"\npoller stopped: turns degraded {time.monotonic() - t_stop:.2f} s after (staleness_s=0.6)")
    p2 = Poller(gate, engines=[e.url], interval_s=0.1, leader_ttl_s=1.0)
    th2 = threading.Thread(target=p2.run, daemon=True)
    t_start = time.monotonic()
    th2.start()
    try:
        wait_until(lambda: p2.writes >= 1, timeout=10)
        lease = gate.acquire("s3", prompt_tokens=100, max_new_tokens=10)
        assert lease.outcome == "admit"
        print(f"poller started again: a turn admitted {time.monotonic() - t_start:.2f} s after")
        lease.release()
        assert not gate.status()["degraded"]
    finally:
        p2.stop()
        th2.join(timeout=10)


@pytest.mark.parametrize("kw", [
    {"engines": ["http://127.0.0.1:1"], "interval_s": 0},
    {"engines": ["http://127.0.0.1:1"], "interval_s": 2.0, "leader_ttl_s": 1.0},
    {"engines": ["http://127.0.0.1:1"], "http_timeout_s": -1},
    {"engines": ["http://127.0.0.1:1"], "concurrency": 0},
    {"engines": ["not-a-url"]},
    {},
    {"router": "http://127.0.0.1:1", "engines": ["http://127.0.0.1:2"]},
])
def test_bad_arguments(redis_url, kw):
    with pytest.raises(ValueError):
        Poller(make_gate(redis_url), **kw)


def test_against_simulated_sglang_cluster_with_dp_and_router_health(redis_url):
    sim = pytest.importorskip("kvgate.tools.sim")
    with sim.SimCluster(2, router=True, tp_size=2, dp_size=2, time_scale=0.01) as c:
        gate = make_gate(redis_url, name="simg")
        p = Poller(gate, router=c.router_url)
        r = p.tick()
        assert r.wrote and not r.errors
        ids = sorted(s.engine_id for s in r.states)
        assert ids == sorted(f"{u}#dp{d}" for u in c.engine_urls for d in (0, 1))
        per_rank = c.stats(0)["ranks"][0]["max_total_num_tokens"]
        assert r.snapshot.capacity_tokens == 4 * per_rank  # 2 engines x 2 DP ranks, TP folded by max
        c.set_worker_healthy(1, False)
        r2 = wait_until(lambda: (lambda t: t if t.snapshot and t.snapshot.n_healthy == 2 else None)(p.tick()),
                        timeout=15, interval=0.2)
        assert r2.snapshot.epoch > r.snapshot.epoch
        assert {s.engine_id for s in r2.states if not s.healthy} == {f"{c.engine_urls[1]}#dp0",
                                                                   f"{c.engine_urls[1]}#dp1"}


def test_poller_survives_redis_restart(fresh_redis, servers):
    from conftest import start_redis

    e = servers(sglang_metrics(10_000, 100))
    gate = kvgate.Gate.from_url(fresh_redis.url, gate="rr", config=kvgate.GateConfig(redis_timeout_s=0.5))
    p = Poller(gate, engines=[e.url], leader_ttl_s=2.0)
    assert p.tick().wrote
    port = fresh_redis.port
    fresh_redis.stop()
    r = p.tick()  # Redis gone: no lease, no write, no exception
    assert not r.leader and not r.wrote
    back = start_redis(port)
    try:
        wait_until(lambda: p.tick().wrote, timeout=20, interval=0.2)  # scripts reload after the restart
        assert not gate.status()["degraded"]
    finally:
        back.stop()


def test_negative_counts_read_as_missing(redis_url, servers):
    good = servers(sglang_metrics(10_000, 100))
    odd = servers("sglang:max_total_num_tokens 1000\nsglang:num_used_tokens -5\nsglang:cache_hit_rate 0.5\n")
    gate = make_gate(redis_url)
    r = Poller(gate, engines=[good.url, odd.url]).tick()
    assert r.wrote
    st = {s.engine_id: s for s in r.states}
    assert st[odd.url].healthy and st[odd.url].used_tokens is None  # negative count -> missing


def test_leader_keeps_its_lease_across_a_redis_stall(redis_url, servers):
    import redis as redis_lib

    e = servers(sglang_metrics(10_000, 100))
    gate = make_gate(redis_url, redis_timeout_s=0.3)
    a = Poller(gate, engines=[e.url], leader_ttl_s=5.0, identity="A")
    b = Poller(make_gate(redis_url), engines=[e.url], leader_ttl_s=5.0, identity="B")
    assert a.tick().wrote
    admin = redis_lib.Redis.from_url(redis_url)
    admin.execute_command("CLIENT", "PAUSE", "1000", "ALL")
    r = a.tick()  # its commands time out: not leader for this tick
    assert not r.leader and not r.wrote
    admin.ping()  # blocks until the pause ends (well within the 5 s lease)
    assert a.tick().wrote  # the lease is still its own: extended, not lost until it expires
    assert a.leader_identity() == "A" and not b.tick().leader


def test_async_gate_is_refused_with_a_clear_message(redis_url):
    agate = kvgate.AsyncGate.from_url(redis_url, gate="pg")
    with pytest.raises(ValueError, match="synchronous kvgate.Gate"):
        Poller(agate, engines=["http://127.0.0.1:1"])


def test_anything_but_a_gate_is_refused_with_a_clear_message(redis_url):
    import redis as redis_lib

    client = redis_lib.Redis.from_url(redis_url)
    try:
        with pytest.raises(ValueError, match="synchronous kvgate.Gate .*got Redis"):
            Poller(client, engines=["http://127.0.0.1:1"])
    finally:
        client.close()


def test_an_async_tick_does_not_stop_the_event_loop_on_a_slow_redis_call(redis_url, servers):
    """``atick``/``arun`` run embedded in an application's loop (the bench does): the tick's
    synchronous Redis calls go to a worker thread, so the loop keeps serving other coroutines
    while one of them is slow."""
    import asyncio

    e = servers(sglang_metrics(10_000, 100))
    gate = make_gate(redis_url)
    spans: list[tuple[float, float]] = []
    real_write = gate.write_snapshot

    def slow_write(states, budget_scale=None):
        t0 = time.monotonic()
        time.sleep(0.3)  # a Redis round trip that stalls
        try:
            return real_write(states, budget_scale)
        finally:
            spans.append((t0, time.monotonic()))

    gate.write_snapshot = slow_write
    p = Poller(gate, engines=[e.url])

    async def main() -> tuple:
        beats: list[float] = []
        done = asyncio.Event()

        async def heartbeat() -> None:
            while not done.is_set():
                beats.append(time.monotonic())
                await asyncio.sleep(0.01)

        hb = asyncio.create_task(heartbeat())
        try:
            r = await p.atick()
        finally:
            done.set()
            await hb
        return r, beats

    r, beats = asyncio.run(main())
    assert r.wrote and len(spans) == 1
    t0, t1 = spans[0]
    during = [b for b in beats if t0 < b < t1]
    assert len(during) >= 3, f"the loop ran {len(during)} times during a 0.3 s Redis call"


def test_one_failed_scrape_does_not_end_every_window(redis_url, servers):
    # a timeout of one engine must not change the healthy set: that bumps the epoch, which
    # ends every session's ownership window (and the recovery a tick later bumps it again)
    e1 = servers(sglang_metrics(10_000, 100))
    e2 = servers(sglang_metrics(20_000, 500))
    gate = make_gate(redis_url)
    p = Poller(gate, engines=[e1.url, e2.url])
    first = p.tick().snapshot
    last_used = 500
    for k in range(3):  # failures that never come twice in a row
        e2.route("GET", "/metrics", html(502))
        r = p.tick()
        assert r.errors[e2.url] and r.wrote
        st = {s.engine_id: s for s in r.states}[e2.url]
        assert st.healthy and st.capacity_tokens == 20_000 and st.used_tokens == last_used  # its last numbers
        last_used = 600 + k
        e2.route("GET", "/metrics", text(sglang_metrics(20_000, last_used)))
        assert p.tick().snapshot.epoch == first.epoch
    assert gate.status()["epoch"] == first.epoch
    assert p.status()["scrapes_bridged"] == 3 and p.status()["scrape_errors"] == 3


def test_what_counts_as_unhealthy_at_once(redis_url, servers):
    good = servers(sglang_metrics(10_000, 100))
    sick = servers(sglang_metrics(10_000, 100))
    router = servers()
    workers = [{"url": good.url, "is_healthy": True}, {"url": sick.url, "is_healthy": True}]
    router.route("GET", "/workers", js({"workers": workers}))
    gate = make_gate(redis_url)
    p = Poller(gate, router=router.url)
    assert p.tick().snapshot.n_healthy == 2
    # the router's own verdict is not a blip
    router.route("GET", "/workers", js({"workers": [workers[0], {"url": sick.url, "is_healthy": False}]}))
    assert p.tick().snapshot.n_healthy == 1
    # back in the router's list, but its scrape fails: there are no recent numbers to stand in
    router.route("GET", "/workers", js({"workers": workers}))
    sick.route("GET", "/metrics", html(502))
    assert p.tick().snapshot.n_healthy == 1
    # an engine that left the router's list comes back with no numbers to stand in
    router.route("GET", "/workers", js({"workers": [workers[0]]}))
    sick.route("GET", "/metrics", text(sglang_metrics(10_000, 100)))
    assert p.tick().snapshot.n_healthy == 1
    router.route("GET", "/workers", js({"workers": workers}))
    assert p.tick().snapshot.n_healthy == 2  # scraped fine: a number to stand in, for the next blip
    router.route("GET", "/workers", js({"workers": [workers[0]]}))
    p.tick()
    router.route("GET", "/workers", js({"workers": workers}))
    sick.route("GET", "/metrics", html(502))
    assert p.tick().snapshot.n_healthy == 1
    # an engine never scraped successfully is unhealthy from its first failure
    new = servers()
    new.route("GET", "/metrics", html(500))
    router.route("GET", "/workers", js({"workers": workers + [{"url": new.url, "is_healthy": True}]}))
    r = p.tick()
    assert {s.engine_id: s.healthy for s in r.states}[new.url] is False
    # unhealthy_after=1: every failed scrape counts at once, as before
    q = Poller(make_gate(redis_url, name="pg1"), engines=[good.url], unhealthy_after=1)
    assert q.tick().snapshot.n_healthy == 1
    good.route("GET", "/metrics", html(502))
    assert q.tick().reason == "no_healthy_engine"


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_unhealthy_after_must_be_a_positive_int(redis_url, bad):
    with pytest.raises(ValueError, match="unhealthy_after"):
        Poller(make_gate(redis_url), engines=["http://127.0.0.1:1"], unhealthy_after=bad)


# -- epochs across outages, leadership terms, ticks that never hang; the poller's knobs and flags ----
def test_epoch_bumps_when_every_engine_goes_down_and_comes_back(redis_url, servers):
    """SPEC 3: the epoch bumps whenever the healthy set changes, also through the empty set.
    Engines that all went down and came back restarted with an empty cache: the ownership
    windows of the old engine set must end."""
    e = servers(sglang_metrics(10_000, 100))  # with admission on, a retained turn opens a window
    gate = make_gate(redis_url)
    p = Poller(gate, engines=[e.url])
    first = p.tick().snapshot
    lease = gate.acquire("s1", prompt_tokens=100, max_new_tokens=10, retain_session=True)
    assert lease.outcome == "admit"
    lease.release()
    assert gate.status()["windows"] == 1
    e.route("GET", "/metrics", html(502))
    for _ in range(p.unhealthy_after):
        r = p.tick()
    assert r.wrote and r.snapshot.n_healthy == 0 and r.snapshot.epoch > first.epoch
    # what reads a snapshot without a healthy engine: clients, status, the scripts
    down = gate.acquire("s2", prompt_tokens=100, max_new_tokens=10)
    assert (down.outcome, down.reason) == ("bypass", "degraded")
    down.release()
    st = gate.status()
    assert st["degraded"] and st["capacity"] == 0 and st["ceiling"] == 0
    assert [x["healthy"] for x in st["engines"]] == [0]
    from kvgate.control.status import render_status
    from rich.console import Console
    with open(os.devnull, "w") as sink:
        Console(width=160, file=sink).print(render_status(st))  # renders without an engine to count
    assert r.housekeep is not None  # housekeeping ran on the same tick, on the empty snapshot
    assert gate.step_metrics()["agentic_kv/budget/degraded"] == 1.0
    e.route("GET", "/metrics", text(sglang_metrics(10_000, 100)))
    back = p.tick().snapshot
    assert back.n_healthy == 1 and back.bumped and back.epoch > first.epoch
    assert not gate.status()["degraded"]
    again = gate.acquire("s1", prompt_tokens=100, max_new_tokens=10, retain_session=True)
    assert again.reason != "reserved_session"  # its window belonged to the engines that went down
    again.release()


def test_a_router_listing_no_engine_is_an_empty_healthy_set(redis_url, servers):
    e = servers(sglang_metrics(10_000, 100))
    router = servers()
    router.route("GET", "/workers", js({"workers": [{"url": e.url, "is_healthy": True}]}))
    gate = make_gate(redis_url)
    p = Poller(gate, router=router.url)
    first = p.tick().snapshot
    router.route("GET", "/workers", js({"workers": []}))
    r = p.tick()
    assert r.wrote and r.reason == "no_engines" and r.snapshot.n_healthy == 0 and r.snapshot.bumped
    st = gate.status()
    assert st["degraded"] and st["engines"] == [] and gate.engine_urls() == []
    router.route("GET", "/workers", js({"workers": [{"url": e.url, "is_healthy": True}]}))
    back = p.tick().snapshot
    assert back.n_healthy == 1 and back.epoch > r.snapshot.epoch > first.epoch


def test_a_reelected_leader_does_not_reuse_its_previous_terms_numbers(redis_url, servers, monkeypatch):
    import kvgate.control.estimates

    monkeypatch.setattr(kvgate.control.estimates, "PREFILL_LOAD_WINDOW_S", 0.0)  # a load from every interval
    body = read_data("vllm_single_metrics.txt")
    e = servers(with_prefill(body, 2.0, 10_000))
    a = Poller(make_gate(redis_url), engines=[e.url], identity="A")
    b = Poller(make_gate(redis_url), engines=[e.url], identity="B")
    assert a.tick().wrote and a.leader_identity() == "A"
    a.release()
    assert b.tick().wrote and not a.tick().leader  # A stands by while B leads
    # B's term: the engine keeps computing; A sees none of it
    e.route("GET", "/metrics", text(with_prefill(body, 50.0, 20_000)))
    assert b.tick().wrote
    b.release()
    r = a.tick()  # A leads again
    assert r.wrote and a.leader_identity() == "A"
    st = r.states[0]
    # first sight in this term: no load averaged over the standby time, no cost smoothed with
    # one measured a term ago (cumulative ratio, as for a poller that just started)
    assert st.prefill_load is None and a.prefill_load_pending
    assert st.prefill_s_per_token == pytest.approx(50.0 / 20_000)
    # and a failed scrape right after is not bridged with numbers of the previous term
    a.release()
    assert b.tick().wrote
    e.route("GET", "/metrics", html(502))
    b.release()
    r = a.tick()
    assert r.leader and {s.engine_id: s.healthy for s in r.states} == {e.url: False}


def test_pollers_keep_writing_when_scraping_outlasts_the_lease(redis_url, servers):
    """concurrency 1 and hanging engines: scraping takes several request deadlines, longer
    than the lease. The leader keeps its lease alive while it scrapes, so the two pollers do
    not take the lease from each other forever with no write."""
    good = servers(sglang_metrics(10_000, 100))
    hung = []
    for _ in range(4):
        h = servers()
        h.route("GET", "/metrics", hang(30))
        hung.append(h)
    engines = [good.url] + [h.url for h in hung]
    kw = dict(engines=engines, concurrency=1, http_timeout_s=0.3, leader_ttl_s=0.9, interval_s=0.2)
    a = Poller(make_gate(redis_url), identity="A", **kw)
    b = Poller(make_gate(redis_url), identity="B", **kw)
    threads = [threading.Thread(target=p.run, daemon=True) for p in (a, b)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: a.writes + b.writes >= 2, timeout=20, what="a snapshot write")
    finally:
        a.stop()
        b.stop()
        for t in threads:
            t.join(timeout=20)
    assert not any(t.is_alive() for t in threads)


class _BlockingLock:
    """A redis-py Lock stand-in whose every call blocks until the test lets it go."""

    def __init__(self, gate: threading.Event, calls: list):
        from types import SimpleNamespace

        self.local = SimpleNamespace(token=None)
        self._gate, self._calls = gate, calls

    def _block(self, what: str) -> None:
        self._calls.append(what)
        self._gate.wait(60)

    def acquire(self, *a, **kw):
        self._block("acquire")
        return False

    def extend(self, *a, **kw):
        self._block("extend")
        return True

    def release(self):
        self._block("release")


class _BlockingRedis:
    """A caller-supplied redis client without a socket timeout, on a Redis that stopped
    answering: every call blocks."""

    def __init__(self):
        self.gate = threading.Event()
        self.calls: list[str] = []

    def lock(self, name, **kw):
        return _BlockingLock(self.gate, self.calls)

    def get(self, *a, **kw):
        self.calls.append("get")
        self.gate.wait(60)


def _in_thread(fn, timeout: float = 20.0):
    """Run fn on a daemon thread; (finished, result). The join's timeout is a bound far above
    the poller's own (a hang shows as a thread still running), not a claim about speed."""
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", fn()), daemon=True)
    t.start()
    t.join(timeout)
    return not t.is_alive(), out.get("r")


def test_a_redis_call_that_never_answers_does_not_hang_the_tick(redis_url, servers):
    e = servers(sglang_metrics(10_000, 100))
    stub = _BlockingRedis()
    p = Poller(make_gate(redis_url), engines=[e.url], redis_client=stub, leader_ttl_s=1.5)
    try:
        done, r = _in_thread(p.tick)
        assert done, "the tick hung on a Redis call"
        assert not r.leader and not r.wrote and r.reason == "standby"  # a failed Redis call
        assert stub.calls == ["acquire"]
        done, r = _in_thread(p.tick)  # the stuck call still holds its thread: the next tick is bounded too
        assert done and not r.leader
        done, _ = _in_thread(p.release)
        assert done
        done, who = _in_thread(p.leader_identity)
        assert done and who is None
    finally:
        stub.gate.set()


def test_a_snapshot_write_that_never_returns_does_not_hang_the_tick(redis_url, servers):
    e = servers(sglang_metrics(10_000, 100))
    gate = make_gate(redis_url)
    release = threading.Event()
    real_write = gate.write_snapshot

    def stuck_write(states, budget_scale=None):
        release.wait(60)
        return real_write(states, budget_scale)

    gate.write_snapshot = stuck_write
    p = Poller(gate, engines=[e.url], leader_ttl_s=1.5)
    try:
        done, r = _in_thread(p.tick)
        assert done, "the tick hung on the snapshot write"
        assert r.leader and not r.wrote and r.reason.startswith("write_failed") and "TimeoutError" in r.reason
    finally:
        release.set()
    gate.write_snapshot = real_write
    assert wait_until(lambda: p.tick().wrote, timeout=20)  # and the poller goes on


def test_the_poller_s_redis_calls_do_not_queue_behind_the_default_executor(redis_url, servers):
    """The default executor also runs asyncio's getaddrinfo (httpx / anyio resolve names there):
    slow DNS for a down engine fills it. The lease must not wait behind it."""
    import asyncio
    import concurrent.futures

    e = servers(sglang_metrics(10_000, 100))
    p = Poller(make_gate(redis_url), engines=[e.url], leader_ttl_s=1.5)
    blocker = threading.Event()

    async def main():
        loop = asyncio.get_running_loop()
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        loop.set_default_executor(pool)
        stuck = loop.run_in_executor(None, blocker.wait, 60)  # a getaddrinfo that does not return
        try:
            return await p.atick()
        finally:
            blocker.set()
            await stuck

    done, r = _in_thread(lambda: asyncio.run(main()))
    blocker.set()
    assert done, "the tick waited for the default executor"
    assert r.leader


def test_leader_gauge_drops_when_the_lease_runs_out_between_ticks(redis_url, servers, monkeypatch):
    """kvgate_poller_leader reads Poller.status()["leader"]: a poller that stalled past its
    lease's TTL must not keep saying it leads until its next tick."""
    import kvgate.control.lease

    e = servers(sglang_metrics(10_000, 100))
    p = Poller(make_gate(redis_url), engines=[e.url], leader_ttl_s=2.0)
    now = [1000.0]
    monkeypatch.setattr(kvgate.control.lease, "_monotonic", lambda: now[0])
    assert p.tick().wrote and p.status()["leader"]
    now[0] += 1.9
    assert p.status()["leader"]
    now[0] += 0.2  # the TTL ran out on the poller's own clock: the lease may be another's now
    assert not p.status()["leader"]


def test_poller_refuses_an_interval_not_below_the_staleness(redis_url):
    gate = make_gate(redis_url, staleness_s=6.0)
    with pytest.raises(ValueError, match="staleness_s"):
        Poller(gate, engines=["http://127.0.0.1:1"], interval_s=6.0, leader_ttl_s=20.0)
    Poller(gate, engines=["http://127.0.0.1:1"], interval_s=5.0, leader_ttl_s=20.0)


def test_poller_logs_the_gate_knobs_it_writes_with(redis_url, caplog):
    import logging

    gate = make_gate(redis_url, headroom=0.8, staleness_s=9.0)
    with caplog.at_level(logging.INFO, logger="kvgate.control.poller"):
        p = Poller(gate, engines=["http://127.0.0.1:1"])
    assert p.status()["knobs"]["headroom"] == 0.8
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "headroom=0.8" in text and "staleness_s=9.0" in text


def _poller_args(monkeypatch, env: dict, *argv: str):
    """The Poller the CLI builds from env + flags (the dry run replaced by a capture)."""
    import kvgate.cli as cli

    for k in [k for k in os.environ if k.startswith("KVGATE_")]:
        monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    seen = {}
    monkeypatch.setattr(cli, "_dry_run", lambda poller: seen.setdefault("p", poller) and 0)
    rc = cli.main(["poller", *argv, "--dry-run"])
    return rc, seen.get("p")


def test_poller_flags_read_kvgate_poller_environment(redis_url, monkeypatch):
    env = {"KVGATE_REDIS_URL": redis_url, "KVGATE_GATE": "envg", "KVGATE_POLLER_INTERVAL_S": "0.5",
           "KVGATE_POLLER_HTTP_TIMEOUT_S": "1.5", "KVGATE_POLLER_CONCURRENCY": "4",
           "KVGATE_POLLER_UNHEALTHY_AFTER": "3", "KVGATE_POLLER_HOUSEKEEP_LIMIT": "7",
           "KVGATE_POLLER_MAX_BODY_BYTES": "65536", "KVGATE_POLLER_LEADER_TTL_S": "9"}
    rc, p = _poller_args(monkeypatch, env, "--engine", "http://127.0.0.1:1")
    assert rc == 0
    assert (p.interval_s, p.http_timeout_s, p.concurrency, p.unhealthy_after, p.housekeep_limit,
            p.max_body_bytes, p.leader_ttl_s) == (0.5, 1.5, 4, 3, 7, 65536, 9.0)
    # a flag beats the environment
    rc, p = _poller_args(monkeypatch, env, "--engine", "http://127.0.0.1:1", "--concurrency", "2")
    assert rc == 0 and p.concurrency == 2 and p.interval_s == 0.5


@pytest.mark.parametrize("env, needle", [
    ({"KVGATE_POLLER_INTERVAL_S": "soon"}, "KVGATE_POLLER_INTERVAL_S"),
    ({"KVGATE_POLLER_CONCURRENCY": "0"}, "KVGATE_POLLER_CONCURRENCY"),
    ({"KVGATE_POLLER_INTERVAL_S": "10"}, "staleness_s"),
])
def test_bad_poller_environment_is_a_clear_error(redis_url, monkeypatch, capsys, env, needle):
    env = {"KVGATE_REDIS_URL": redis_url, "KVGATE_GATE": "envg", "KVGATE_POLLER_LEADER_TTL_S": "30", **env}
    with pytest.raises(SystemExit) as ei:
        _poller_args(monkeypatch, env, "--engine", "http://127.0.0.1:1")
    assert ei.value.code == 2
    assert needle in capsys.readouterr().err
