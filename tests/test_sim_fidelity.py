"""Simulator behaviours checked against SGLang 0.5.23's source (docs/simulator.md).

Each test pins one place where the simulator used to differ from SGLang: session pins,
client disconnects, the max prefix length, retraction of the last request, /get_server_info,
metric names and labels, proxy read timeouts, and the small routes and shapes.
"""
from __future__ import annotations

import asyncio
import socket
import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvgate.tools.sim import PrefixCache, RankScheduler, Req, SimCluster, SimEngine, block_hashes, load_profile

from _httphelpers import wait_until
from _simhelpers import B, SMALL, client, rand_ids

TINY = dict(SMALL, kv_capacity_tokens=64 * B)           # 64 blocks


def gen(c: httpx.Client, url: str, ids, max_new=8, **extra) -> dict:
    r = c.post(url + "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": max_new},
                                        **extra})
    assert r.status_code == 200, r.text
    return r.json()


def drain(s: RankScheduler, limit: int = 100000) -> None:
    for _ in range(limit):
        it = s.begin_iteration()
        if it is None:
            return
        s.end_iteration(it)
        s.cache.check()
    raise AssertionError("the scheduler did not go idle")


def samples(text: str) -> list:
    return [s for f in text_string_to_metric_families(text) for s in f.samples]


# ------------------------------------------------------------ 1. session pins are evictable
def test_session_pins_are_evictable_after_unpinned_blocks_and_count_as_evictable():
    # SGLang (unified radix tree, --radix-eviction-policy priority): a session reference only
    # orders eviction ((session_ref > 0, session_ref, priority)); only a running request's
    # lock_ref protects a block, and num_used = max_total - (available + evictable)
    s = RankScheduler(load_profile(**TINY), session_radix_cache=True)
    for k in range(3):
        s.submit(Req(f"t{k}", rand_ids(k, 300), 8, session_id=f"sess-{k}"))
    drain(s)
    pinned = 3 * ((300 + 7) // B)                               # 57 blocks
    assert len(s.sessions) == 3
    assert s.cache.used_blocks == 0 and s.cache.evictable_blocks == pinned
    big = Req("big", rand_ids(9, 420), 8)                       # needs 27 blocks; 7 are free
    s.submit(big)
    drain(s)
    assert big.finish_reason == {"type": "length", "length": 8}
    assert s.num_queued == 0 and s.num_running == 0 and s.cache.evicted_blocks >= 20
    # evicted blocks left their sessions' lists; what is still pinned is still cached
    left = sum(len(p) for p in s.sessions.values())
    assert left < pinned
    assert all(s.cache.is_cached(h) for p in s.sessions.values() for h in p)
    assert s.close_session("sess-2") in (True, False)
    s.cache.check()


def test_eviction_takes_unpinned_blocks_before_session_pinned_ones():
    c = PrefixCache(4 * B, B)
    a = block_hashes(list(range(2 * B)), B)                    # the session's blocks
    u = block_hashes(list(range(100, 100 + 2 * B)), B)         # nobody's blocks
    for hs in (a, u):
        assert c.alloc_private(2)
        c.commit(hs)
    c.set_session("s", a)
    c.release(a)                                               # a: unlocked, pinned
    c.release(u)                                               # u: unlocked, released last (MRU)
    assert c.used_blocks == 0 and c.evictable_blocks == 4 and c.pinned_evictable_blocks == 2
    assert c.alloc_private(2)                                  # takes u although u is newer
    assert c.match(u) == 0 and c.match(a) == 2
    assert c.alloc_private(1)                                  # then the session's tail
    assert c.match(a) == 1 and list(c.sessions["s"]) == [a[0]]
    assert c.drop_session("s") and not c.drop_session("s")
    assert c.pinned_evictable_blocks == 0 and c.evictable_blocks == 1
    c.check()


def test_session_kv_does_not_block_a_new_request_over_http():
    # the reviewer's repro: 64-block pool, 3 sessions done, a 420-token request used to stay
    # queued (running 0) until /close_session
    with SimCluster(1, time_scale=0.0, router=False, session_radix_cache=True, **TINY) as sim, \
            client(timeout=10.0) as c:
        url = sim.engine_urls[0]
        for k in range(3):
            gen(c, url, rand_ids(k, 300), 8, session_id=f"sess-{k}")
        st = sim.stats(0)["ranks"][0]
        assert st["num_used_tokens"] == 0 and st["kv_evictable_tokens"] == 57 * B
        assert gen(c, url, rand_ids(9, 420), 8)["meta_info"]["finish_reason"]["type"] == "length"


# ------------------------------------------------------------ 2. client disconnects abort
def _post_and_hang_up(url: str, ids: list, max_new: int, running) -> None:
    """Send /generate on a raw socket, wait until the engine runs it, then close the socket."""
    host, port = url.rsplit("//", 1)[1].split(":")
    body = ('{"input_ids": %s, "sampling_params": {"max_new_tokens": %d}}' % (ids, max_new)).encode()
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        wait_until(running, 10.0, what="the request to run")


@pytest.mark.parametrize("via_router", [False, True])
def test_client_disconnect_aborts_the_request(monkeypatch, via_router):
    # SGLang's tokenizer manager wakes every SGLANG_REQUEST_STATE_WAIT_TIMEOUT (4 s), checks
    # request.is_disconnected() and aborts; the router drops the upstream request
    import kvgate.tools.sim.http as simhttp
    monkeypatch.setattr(simhttp, "DISCONNECT_POLL_S", 0.1, raising=False)
    with SimCluster(1, time_scale=1.0, router=via_router, health_check_interval_s=None,
                    **SMALL) as sim:
        def st():
            return sim.stats(0)["total"]
        # 1,900 decode steps of >= 13 ms: ~25 s of wall time if nobody aborts it
        _post_and_hang_up(sim.urls[0], rand_ids(1, 100), 1900, lambda: st()["num_running_reqs"] == 1)
        wait_until(lambda: st()["num_aborted_requests"] == 1, 8.0, what="the abort")
        assert st()["num_running_reqs"] == 0 and st()["num_requests"] == 0
        assert sim.stats(0)["ranks"][0]["num_used_tokens"] == 0


# ------------------------------------------------------------ 3. max prefix = input_len - 1
def test_a_fully_cached_prompt_still_computes_one_token():
    s = RankScheduler(load_profile(**SMALL))
    done = []
    for rid, n in (("a", 2 * B), ("b", 2 * B), ("c", 2 * B + 1)):
        s.submit(Req(rid, list(range(1, n + 1)), 1, on_done=done.append))
        drain(s)
    a, b, c = done
    assert a.cached_tokens == 0
    assert b.cached_tokens == B            # 32-token prompt fully cached: at most 31 matched
    assert c.cached_tokens == 2 * B        # 33 tokens: both full blocks usable
    assert s.prefill_computed_tokens == 2 * B + B + 1


# ------------------------------------------------------------ 4. the last request is kept
def test_the_last_running_request_is_never_retracted():
    s = RankScheduler(load_profile(**TINY))
    r = Req("only", rand_ids(5, 100), 200)
    s.submit(r)
    s.end_iteration(s.begin_iteration())               # prefill: 7 blocks held
    assert r.state == "running"
    assert s.cache.alloc_private(s.cache.available_blocks())   # the rest of the pool: elsewhere
    for _ in range(1000):
        it = s.begin_iteration()
        if it is None:
            break
        s.end_iteration(it)
    # SGLang's retract_decode keeps one request; when even it cannot grow it is aborted (500)
    assert s.retractions == 0 and s.num_queued == 0 and s.num_running == 0
    assert r.finish_reason["type"] == "abort" and r.finish_reason["status_code"] == 500
    s.cache.check()


# ------------------------------------------------------------ 5. /get_server_info
def test_server_info_has_max_total_num_tokens_on_top_and_token_capacity_per_rank():
    with SimCluster(1, time_scale=0.0, router=False, dp_size=2, **SMALL) as sim, client() as c:
        for path in ("/get_server_info", "/server_info"):
            info = c.get(sim.engine_urls[0] + path).json()
            assert info["max_total_num_tokens"] == 2048
            assert len(info["internal_states"]) == 2
            for st in info["internal_states"]:
                assert st["memory_usage"]["token_capacity"] == 2048
                assert "max_total_num_tokens" not in st


# ------------------------------------------------------------ 6. metric names and labels
def test_metrics_names_and_label_sets_match_sglang():
    from kvgate.control import promparse
    prof = load_profile(**SMALL)
    with SimCluster(1, time_scale=0.0, router=False, tp_size=2, **SMALL) as sim, client() as c:
        url = sim.engine_urls[0]
        gen(c, url, rand_ids(3, 300), 4)
        body = c.get(url + "/metrics").text
        ss = samples(body)
        names = {s.name for s in ss}
        assert not any(n.startswith("sglang:cache_config_info") for n in names)   # vLLM's name
        sched = {"model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank"}
        for name, want in (("sglang:page_size", B), ("sglang:num_pages", 2048 // B),
                           ("sglang:context_len", prof.max_context)):
            rows = [s for s in ss if s.name == name]
            assert sorted(s.labels["tp_rank"] for s in rows) == ["0", "1"], name
            assert all(set(s.labels) == sched and s.value == want for s in rows), name
        tok = {"model_name", "engine_type"}
        for name, extra in (("sglang:prompt_tokens_total", {"is_streaming"}),
                            ("sglang:generation_tokens_total", {"is_streaming"}),
                            ("sglang:num_requests_total", {"is_streaming"}),
                            ("sglang:cached_tokens_total", {"cache_source"}),
                            ("sglang:num_aborted_requests_total", set())):
            rows = [s for s in ss if s.name == name]
            assert len(rows) == 1 and set(rows[0].labels) == tok | extra, (name, rows)
            assert rows[0].labels["engine_type"] == "unified"
        assert [s.labels["is_streaming"] for s in ss if s.name == "sglang:num_requests_total"] == ["false"]
        # kvgate's own parser still reads what it needs
        rank = promparse.parse_metrics(body).ranks[0]
        assert rank.capacity_tokens == 2048 and rank.used_tokens == 0
        assert rank.evictable_tokens > 0 and rank.running_requests == 0 and rank.queued_requests == 0


# ------------------------------------------------------------ 7. proxy read timeout
def test_router_read_timeout_is_a_504_and_the_worker_stays_healthy(monkeypatch):
    import kvgate.tools.sim.http as simhttp
    monkeypatch.setattr(simhttp, "DISCONNECT_POLL_S", 0.1, raising=False)
    with SimCluster(2, time_scale=1.0, health_check_interval_s=None, **SMALL) as sim, client() as c:
        def short_timeouts():
            for w in sim.router.workers.values():
                w.pool.timeout_s = 0.3
        sim.call(short_timeouts)
        r = c.post(sim.router_url + "/generate",
                   json={"input_ids": rand_ids(2, 100), "sampling_params": {"max_new_tokens": 1900}})
        assert r.status_code == 504, r.text
        ws = c.get(sim.router_url + "/workers").json()
        assert ws["stats"]["healthy_workers"] == 2                      # not marked down
        assert sim.call(lambda: sum(w.requests for w in sim.router.workers.values())) == 1  # no retry
        # the router closed the upstream connection: the engine aborts the request
        wait_until(lambda: sum(sim.stats(i)["total"]["num_aborted_requests"] for i in range(2)) == 1,
                   8.0, what="the engine to abort the timed-out request")


# ------------------------------------------------------------ 8. small things
def test_open_session_returns_the_id_and_refuses_an_open_one():
    with SimCluster(1, time_scale=0.0, router=False, session_radix_cache=True, **SMALL) as sim, \
            client() as c:
        url = sim.engine_urls[0]
        r = c.post(url + "/open_session", json={"capacity_of_str_len": 1000})
        assert r.status_code == 200 and isinstance(r.json(), str) and len(r.json()) == 32
        r = c.post(url + "/open_session", json={"capacity_of_str_len": 1000, "session_id": "abc"})
        assert r.status_code == 200 and r.json() == "abc"
        r = c.post(url + "/open_session", json={"capacity_of_str_len": 1000, "session_id": "abc"})
        assert r.status_code == 400 and "still open" in r.text
        assert c.post(url + "/open_session", json={"session_id": "x"}).status_code == 400
        assert c.post(url + "/close_session", json={"session_id": "abc"}).status_code == 200
        r = c.post(url + "/open_session", json={"capacity_of_str_len": 1000, "session_id": "abc"})
        assert r.status_code == 200 and r.json() == "abc"
        gen(c, url, rand_ids(4, 200), 4, session_id="abc")
        assert sim.stats(0)["ranks"][0]["open_sessions"] == 1


def test_abort_request_matches_rid_prefixes_and_finish_reasons_have_sglang_shape():
    # SGLang: the tokenizer manager drops an abort whose rid is not in flight (one tokenizer
    # worker); the scheduler then aborts every request whose rid starts with it
    with SimCluster(1, time_scale=1.0, router=False, **dict(SMALL, kv_capacity_tokens=8192,
                                                           max_running_requests=2)) as sim, \
            client() as c:
        eng = sim.engines[0]
        done: dict = {}

        def submit(rid, seed):
            eng.submit(rand_ids(seed, 100), 1500, rid=rid, on_done=lambda r: done.__setitem__(r.rid, r))
        for i, rid in enumerate(("job-1", "job-1-retry", "job-2")):   # job-2 waits: 2 run at most
            sim.call(submit, rid, i)
        wait_until(lambda: sim.stats(0)["total"]["num_running_reqs"] == 2, 10.0, what="two running")
        url = sim.engine_urls[0]
        assert c.post(url + "/abort_request", json={"rid": "job"}).status_code == 200   # no such rid
        assert c.post(url + "/abort_request", json={"rid": "job-1"}).status_code == 200
        # 1,500 decode steps of >= 13 ms: ~20 s unless aborted
        wait_until(lambda: {"job-1", "job-1-retry"} <= set(done), 6.0, what="both job-1 requests")
        for rid in ("job-1", "job-1-retry"):
            assert done[rid].finish_reason == {"type": "abort", "message": "Aborted",
                                               "status_code": None, "err_type": None}
        assert "job-2" not in done
        # job-2 is admitted now; abort it, and a queued one, by exact rid
        sim.call(submit, "job-3", 3)
        sim.call(submit, "job-4", 4)
        wait_until(lambda: sim.stats(0)["total"]["num_queue_reqs"] == 1, 10.0, what="job-4 queued")
        c.post(url + "/abort_request", json={"rid": "job-4"})
        wait_until(lambda: "job-4" in done, 10.0, what="job-4 aborted")
        assert done["job-4"].finish_reason == {"type": "abort", "message": "Abort in waiting queue"}


def test_closed_sessions_leave_bounded_state_and_late_turns_do_not_pin():
    s = RankScheduler(load_profile(**SMALL), session_radix_cache=True)
    for k in range(10000):
        s.close_session(f"gone-{k}")
    sizes = {k: len(v) for k, v in vars(s).items() if isinstance(v, dict)}
    assert max(sizes.values()) <= 8192, sizes           # SGLang keeps at most 8192 tombstones
    late = Req("late", rand_ids(6, 100), 4, session_id="s")
    s.submit(late)
    s.close_session("s")                                 # closed while the turn is queued
    drain(s)
    assert late.finish_reason["type"] == "length" and "s" not in s.sessions
    s.submit(Req("next", rand_ids(6, 120), 4, session_id="s"))   # a new turn reopens it
    drain(s)
    assert "s" in s.sessions


def test_sim_stop_keeps_a_reference_to_its_task(monkeypatch):
    gate = threading.Event()
    real_stop = SimCluster._astop_engine

    async def slow_stop(self, i):
        while not gate.is_set():
            await asyncio.sleep(0.01)
        await real_stop(self, i)

    monkeypatch.setattr(SimCluster, "_astop_engine", slow_stop)
    with SimCluster(1, time_scale=0.0, router=False, **SMALL) as sim, client() as c:
        assert c.post(sim.engine_urls[0] + "/sim/stop").status_code == 200
        wait_until(lambda: sim.call(lambda: len(getattr(sim, "_bg_tasks", ()))) == 1, 5.0,
                   what="the stop task to be held")
        gate.set()
        wait_until(lambda: sim.call(lambda: len(sim._bg_tasks)) == 0, 5.0, what="the stop task to finish")


def test_engine_without_http_keeps_working():
    async def run():
        eng = SimEngine(load_profile(**SMALL), time_scale=0)
        await eng.start()
        try:
            r1 = await eng.generate(rand_ids(7, 64), 4)
            r2 = await eng.generate(rand_ids(7, 64), 4)
        finally:
            await eng.stop()
        return r1, r2
    r1, r2 = asyncio.run(run())
    assert r1.output_ids == r2.output_ids and r2.cached_tokens == 48    # 63 tokens matchable
