"""The SGLang engine + router simulator: cache model, scheduler, and real HTTP on loopback."""
from __future__ import annotations

import asyncio
import json
import random
import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvgate.tools.sim import (HttpPool, PrefixCache, RankScheduler, Req, SimCluster, available_profiles,
                        block_hashes, load_profile, output_tokens)

from _simhelpers import B, SMALL, client, rand_ids

def gen(c: httpx.Client, url: str, ids, max_new=8, **extra) -> dict:
    r = c.post(url + "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": max_new,
                                                                              "temperature": 0},
                                        **extra})
    assert r.status_code == 200, r.text
    return r.json()


def metrics(c: httpx.Client, url: str) -> dict:
    """{(name, frozenset(labels)): value} of every sample."""
    out = {}
    for fam in text_string_to_metric_families(c.get(url + "/metrics").text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def metric(m: dict, name: str, **labels) -> float:
    vals = [v for (n, ls), v in m.items() if n == name and set(labels.items()) <= ls]
    assert vals, f"no sample {name} {labels}"
    return max(vals)


# ---------------------------------------------------------------- pure model
def test_block_hashes_chain_and_full_blocks_only():
    toks = list(range(40))
    h = block_hashes(toks, B)
    assert len(h) == 2                                    # 40 tokens -> 2 full blocks
    assert block_hashes(toks[:32], B) == h                # same prefix, same hashes
    assert block_hashes(toks[16:32], B) != h[1:]          # chained: depends on the parent
    assert block_hashes(toks, B, parent=h[0], start=16) == h[1:]


def test_cache_lru_evicts_tail_first_and_respects_refs():
    c = PrefixCache(4 * B, B)
    a = block_hashes(list(range(3 * B)), B)
    assert c.alloc_private(3)
    c.commit(a)                                            # one reference each
    assert c.match(a) == 3 and c.used_blocks == 3 and c.free_blocks == 1
    assert not c.alloc_private(2)                          # referenced blocks never evicted
    c.release(a)                                           # released in reverse: tail is LRU
    assert c.evictable_blocks == 3 and c.used_blocks == 0
    assert c.alloc_private(2)                              # 1 free + 1 evicted
    assert c.evicted_blocks == 1 and c.match(a) == 2       # the tail block went first
    c.acquire(a[:2])
    assert not c.alloc_private(1)
    c.check()


def _drain(s: RankScheduler, limit: int = 200000) -> int:
    n = 0
    while True:
        it = s.begin_iteration()
        if it is None:
            return n
        s.end_iteration(it)
        s.cache.check()
        n += 1
        assert n < limit


def test_scheduler_retracts_newest_and_output_is_deterministic():
    # an optimistic new_token_ratio overcommits decode space, so decode must retract
    prof = load_profile(**SMALL, init_new_token_ratio=0.05)
    s = RankScheduler(prof)
    reqs = [Req(f"r{i}", rand_ids(i, 200), 400) for i in range(4)]
    for r in reqs:
        s.submit(r)
    _drain(s)
    assert s.retractions > 0
    assert all(r.finish_reason == {"type": "length", "length": 400} for r in reqs)
    for r in reqs:  # retraction recomputes, it does not change what is generated
        assert r.output_ids == output_tokens(hash(tuple(r.input_ids)), 400, prof.vocab_size)
    assert s.cache.used_blocks == 0 and s.num_running == 0 and s.num_queued == 0
    assert s.prefill_computed_tokens > sum(r.prompt_len for r in reqs)   # recomputation is charged


# ------------------------------------------------------------------ profiles
def test_profiles_load_by_name_path_and_reject_unknown(tmp_path):
    assert "gpu-h100-30b" in available_profiles()
    p = load_profile()
    assert p.name == "gpu-h100-30b" and p.source and p.kv_capacity_tokens > 0
    with pytest.raises(ValueError, match="available: .*gpu-h100-30b"):
        load_profile("no-such-profile")
    f = tmp_path / "mine.json"
    f.write_text(json.dumps({**p.to_dict(), "name": "mine", "block_size": 32}))
    assert load_profile(str(f)).block_size == 32
    f.write_text(json.dumps({"name": "broken", "block_size": 16}))
    with pytest.raises(ValueError, match="lacks required fields"):
        load_profile(str(f))
    with pytest.raises(ValueError, match="block_size"):
        load_profile(block_size=0)


# ---------------------------------------------------------------- over HTTP
@pytest.fixture(scope="module")
def one():
    with SimCluster(1, time_scale=0.0, router=False, **SMALL) as sim:
        yield sim


@pytest.fixture()
def fresh():
    with SimCluster(1, time_scale=0.0, router=False, **SMALL) as sim:
        yield sim


def test_second_turn_of_a_session_hits_the_cache(one):
    url = one.engine_urls[0]
    with client() as c:
        p1 = rand_ids(10, 300)
        r1 = gen(c, url, p1, 20, session_id="s-hit")
        assert r1["meta_info"]["cached_tokens"] == 0 and len(r1["output_ids"]) == 20
        assert r1["meta_info"]["finish_reason"] == {"type": "length", "length": 20}
        p2 = p1 + r1["output_ids"] + rand_ids(11, 40)
        r2 = gen(c, url, p2, 20, session_id="s-hit")
        # prompt + output[:-1] is cached in full blocks
        assert r2["meta_info"]["cached_tokens"] == (300 + 19) // B * B
        assert r2["meta_info"]["prompt_tokens"] == len(p2)
        assert gen(c, url, p1, 20)["output_ids"] == r1["output_ids"]     # deterministic


def test_lru_eviction_when_the_pool_overflows(fresh):
    url = fresh.engine_urls[0]
    with client() as c:
        first = rand_ids(20, 600)
        gen(c, url, first, 4)
        assert gen(c, url, first, 4)["meta_info"]["cached_tokens"] == 592
        hit_before = metric(metrics(c, url), "sglang:cache_hit_rate")
        for i in range(6):                                  # 6 x 600 tokens through a 2048-token pool
            assert gen(c, url, rand_ids(100 + i, 600), 4)["meta_info"]["cached_tokens"] == 0
        again = gen(c, url, first, 4)
        assert again["meta_info"]["cached_tokens"] == 0     # evicted
        m = metrics(c, url)
        assert metric(m, "kvgate_sim:evicted_tokens_total") > 0
        assert metric(m, "sglang:cache_hit_rate") < hit_before
        assert metric(m, "sglang:prompt_tokens_total") == 600 * 9
        assert metric(m, "sglang:cached_tokens_total", cache_source="device") == 592
        assert metric(m, "sglang:num_used_tokens") == 0     # nothing running: all evictable/free
        assert metric(m, "sglang:kv_evictable_tokens") > 0


@pytest.mark.parametrize("process", [False, True])
def test_prefill_time_is_exported_only_when_asked(process):
    # SGLang exports no prefill time; with prefill_metrics the simulator adds one (simulator-only
    # name), summed per request over each prefill batch as vLLM does, in wall time, which the
    # poller's parser reads as it reads vLLM's histogram sums
    from kvgate.control import promparse
    prof = load_profile("gpu-h100-30b", **SMALL)
    scale = 0.001
    with SimCluster(1, time_scale=scale, router=False, process=process, prefill_metrics=True, **SMALL) as sim, \
            SimCluster(1, time_scale=0.0, router=False, **SMALL) as plain, client() as c:
        url = sim.engine_urls[0]
        p1 = rand_ids(30, 600)
        gen(c, url, p1, 4)
        gen(c, url, p1, 4)  # 592 tokens cached: 8 computed
        want = (2 * prof.prefill_base_s + (600 + 8) * prof.prefill_s_per_token) * scale
        assert metric(metrics(c, url), "kvgate_sim:prefill_seconds_total") == pytest.approx(want)
        rank = promparse.parse_metrics(c.get(url + "/metrics").text).ranks[0]
        assert rank.prefill_seconds == pytest.approx(want) and rank.prefill_tokens == 608
        gen(c, plain.engine_urls[0], p1, 4)
        body = c.get(plain.engine_urls[0] + "/metrics").text
        assert "kvgate_sim:prefill_seconds_total" not in body
        assert promparse.parse_metrics(body).ranks[0].prefill_seconds is None


def test_queue_time_counts_the_wait_for_the_batch_in_wall_time():
    # sglang:queue_time_seconds (both engines export one: vLLM's request_queue_time_seconds):
    # a request that arrives while another's prefill runs waits for the rest of that iteration,
    # in engine time x time_scale; one submitted to an idle engine waits nothing
    from kvgate.control import promparse
    prof = load_profile("gpu-h100-30b", **SMALL)
    sched = RankScheduler(prof)
    a, b = Req("a", rand_ids(31, 600), 4), Req("b", rand_ids(32, 600), 4)
    sched.submit(a)
    it = sched.begin_iteration()          # a's prefill: a waited nothing
    sched.submit(b, elapsed_s=it.duration_s / 4)  # b arrives a quarter into it
    sched.end_iteration(it)
    sched.end_iteration(sched.begin_iteration())  # b's prefill starts after a's
    assert (sched.queue_seconds, sched.queued_requests) == (pytest.approx(0.75 * it.duration_s), 2)
    with SimCluster(1, time_scale=0.001, router=False, **SMALL) as sim, client() as c:
        url = sim.engine_urls[0]
        gen(c, url, rand_ids(33, 600), 4)
        body = c.get(url + "/metrics").text
        assert metric(metrics(c, url), "sglang:queue_time_seconds_count") == 1
        assert promparse.parse_metrics(body).ranks[0].queue_seconds == pytest.approx(0.0)


def test_probe_is_read_only_and_agrees_with_the_engine(fresh):
    url = fresh.engine_urls[0]
    with client() as c:
        p1 = rand_ids(30, 500)
        out = gen(c, url, p1, 10)["output_ids"]
        p2 = p1 + out + rand_ids(31, 50)
        before = metrics(c, url)
        stats_before = fresh.stats(0)
        for _ in range(5):
            pr = c.post(url + "/kvgate/probe", json={"prompt_ids": p2, "session_id": "x"}).json()
        assert metrics(c, url) == before and fresh.stats(0) == stats_before
        assert pr["total_tokens"] == len(p2) and pr["total_blocks"] == len(p2) // B
        assert pr["block_size"] == B and pr["cached_tokens"] == pr["cached_blocks"] * B
        assert pr["hit_ratio"] == pytest.approx(pr["cached_tokens"] / len(p2))
        assert gen(c, url, p2, 4)["meta_info"]["cached_tokens"] == pr["cached_tokens"] > 0
        assert c.post(url + "/kvgate/probe", json={"prompt_ids": []}).json()["hit_ratio"] == 0.0
        u = c.get(url + "/kvgate/usage").json()
        assert u["num_gpu_blocks"] == 2048 // B and u["block_size"] == B
        assert u["usage"] == 0.0 and u["num_free_blocks"] == u["num_gpu_blocks"]


def test_close_session_frees_session_kv_in_session_radix_mode():
    with SimCluster(1, time_scale=0.0, router=False, session_radix_cache=True, **SMALL) as sim, \
            client() as c:
        url = sim.engine_urls[0]
        p1 = rand_ids(40, 500)
        r1 = gen(c, url, p1, 10, session_id="agent-1")
        m = metric(metrics(c, url), "sglang:num_used_tokens")
        assert m == 0                                         # session KV is evictable, not used
        m = metrics(c, url)
        assert metric(m, "kvgate_sim:open_sessions") == 1
        assert metric(m, "sglang:kv_evictable_tokens") == (500 + 9) // B * B
        assert metric(m, "kvgate_sim:session_pinned_tokens") == (500 + 9) // B * B
        for i in range(4):      # pressure the unpinned blocks can absorb does not evict the session
            gen(c, url, rand_ids(200 + i, 700), 4)
        p2 = p1 + r1["output_ids"] + rand_ids(41, 20)
        assert gen(c, url, p2, 4, session_id="agent-1")["meta_info"]["cached_tokens"] == (500 + 9) // B * B
        for method in ("post", "get"):
            r = c.request(method.upper(), url + "/close_session", json={"session_id": "agent-1"})
            assert r.status_code == 200 and r.content == b""   # idempotent, empty 200
        m = metrics(c, url)
        assert metric(m, "sglang:num_used_tokens") == 0
        assert metric(m, "sglang:kv_evictable_tokens") >= (500 + 9) // B * B
        assert metric(m, "kvgate_sim:open_sessions") == 0
        assert metric(m, "kvgate_sim:session_pinned_tokens") == 0   # back to plain LRU order


def test_tp_ranks_repeat_per_engine_values_and_dp_ranks_are_labelled():
    with SimCluster(1, time_scale=0.0, router=False, tp_size=2, **SMALL) as sim, client() as c:
        url = sim.engine_urls[0]
        gen(c, url, rand_ids(50, 300), 4, session_id="s")
        fams = {f.name: f for f in text_string_to_metric_families(c.get(url + "/metrics").text)}
        for name in ("sglang:max_total_num_tokens", "sglang:num_used_tokens", "sglang:token_usage",
                     "sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:cache_hit_rate",
                     "sglang:kv_available_tokens", "sglang:kv_evictable_tokens"):
            samples = fams[name].samples
            assert sorted(s.labels["tp_rank"] for s in samples) == ["0", "1"], name
            assert len({s.value for s in samples}) == 1, name
            assert all(s.labels["model_name"] and s.labels["engine_type"] == "unified"
                       and s.labels["pp_rank"] == "0" and "dp_rank" not in s.labels for s in samples)
        assert fams["sglang:max_total_num_tokens"].samples[0].value == 2048
        assert fams["sglang:kv_evictable_tokens"].samples[0].value > 0
        # request counters come once per server, like SGLang's tokenizer metrics
        assert len(fams["sglang:prompt_tokens"].samples) == 1
    with SimCluster(1, time_scale=0.0, router=False, tp_size=2, dp_size=2, **SMALL) as sim, \
            client() as c:
        fams = {f.name: f for f in text_string_to_metric_families(c.get(sim.engine_urls[0] + "/metrics").text)}
        labs = {(s.labels["dp_rank"], s.labels["tp_rank"]) for s in fams["sglang:token_usage"].samples}
        assert labs == {("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")}


def test_router_workers_list_workers_health_and_sticky_routing():
    with SimCluster(3, time_scale=0.0, health_check_interval_s=None, **SMALL) as sim, client() as c:
        r = c.get(sim.router_url + "/workers").json()
        assert r["total"] == 3 and r["stats"]["healthy_workers"] == 3
        assert {w["url"] for w in r["workers"]} == set(sim.engine_urls)
        w0 = r["workers"][0]
        assert {"id", "url", "model_id", "worker_type", "is_healthy", "load"} <= set(w0)
        assert w0["worker_type"] == "regular" and w0["is_healthy"] is True
        assert c.get(sim.router_url + "/list_workers").json() == {"urls": sim.engine_urls}
        # sticky: every turn of a session lands on the same engine
        for k in range(6):
            for t in range(3):
                gen(c, sim.router_url, rand_ids(k, 100 + 20 * t), 2, session_id=f"sticky-{k}")
        per_engine = [sim.stats(i)["total"]["num_requests"] for i in range(3)]
        assert sum(per_engine) == 18 and all(n % 3 == 0 for n in per_engine)
        # the router does not proxy /close_session
        assert c.post(sim.router_url + "/close_session", json={"session_id": "x"}).status_code == 404
        # unhealthy worker: shown in /workers and avoided
        sim.set_worker_healthy(1, False)
        ws = {w["url"]: w for w in c.get(sim.router_url + "/workers").json()["workers"]}
        assert ws[sim.engine_urls[1]]["is_healthy"] is False
        before = sim.stats(1)["total"]["num_requests"]
        for k in range(8):
            gen(c, sim.router_url, rand_ids(900 + k, 50), 2, session_id=f"moved-{k}")
            gen(c, sim.router_url, rand_ids(950 + k, 50), 2)
        assert sim.stats(1)["total"]["num_requests"] == before
        sim.set_worker_healthy(1, True)
        assert c.get(sim.router_url + "/workers").json()["stats"]["healthy_workers"] == 3


def test_older_router_without_workers_endpoint():
    with SimCluster(2, time_scale=0.0, workers_endpoint=False, health_check_interval_s=None,
                    **SMALL) as sim, client() as c:
        assert c.get(sim.router_url + "/workers").status_code == 404
        assert c.get(sim.router_url + "/list_workers").json()["urls"] == sim.engine_urls


def test_stopped_engine_refuses_and_router_moves_its_sessions():
    with SimCluster(2, time_scale=0.0, health_check_interval_s=None, **SMALL) as sim, client() as c:
        on0 = [sid for sid in (f"d-{k}" for k in range(200))
               if sim.call(sim.router.pick, sid).url == sim.engine_urls[0]][:3]
        assert on0
        sim.stop_engine(0)
        with pytest.raises(httpx.ConnectError):
            c.get(sim.engine_urls[0] + "/health")
        for k, sid in enumerate(on0):   # sessions hashed to the dead engine are retried on the live one
            assert gen(c, sim.router_url, rand_ids(k, 64), 2, session_id=sid)["output_ids"]
        assert sim.stats(1)["total"]["num_requests"] == len(on0)
        ws = {w["url"]: w["is_healthy"] for w in c.get(sim.router_url + "/workers").json()["workers"]}
        assert ws == {sim.engine_urls[0]: False, sim.engine_urls[1]: True}
        sim.start_engine(0)
        assert c.get(sim.engine_urls[0] + "/health").status_code == 200


def test_abort_request_finishes_with_abort():
    with SimCluster(1, time_scale=1.0, router=False, **SMALL) as sim, client() as c:
        url = sim.engine_urls[0]
        res = {}

        def run():
            res["r"] = gen(c, url, rand_ids(1, 100), 1000, rid="long-one")

        t = threading.Thread(target=run)
        t.start()
        for _ in range(200):
            if sim.stats(0)["total"]["num_running_reqs"]:
                break
            threading.Event().wait(0.01)
        assert c.post(url + "/abort_request", json={"rid": "long-one"}).status_code == 200
        t.join(10)
        assert res["r"]["meta_info"]["finish_reason"]["type"] == "abort"
        assert res["r"]["meta_info"]["completion_tokens"] < 1000
        assert metric(metrics(c, url), "sglang:num_aborted_requests_total") == 1
        assert sim.stats(0)["ranks"][0]["num_used_tokens"] == 0


@pytest.mark.parametrize("path,body,needle", [
    ("/generate", b"not json", "not valid JSON"),
    ("/generate", b"[1,2]", "JSON object"),
    ("/generate", b"{}", "input_ids is required"),
    ("/generate", b'{"text": "hi"}', "no tokenizer"),
    ("/generate", b'{"input_ids": []}', "non-empty"),
    ("/generate", b'{"input_ids": [1, "a"]}', "integers"),
    ("/generate", b'{"input_ids": [1, 99999999]}', "integers"),
    ("/generate", b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}}', "max_new_tokens"),
    ("/generate", b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 5000}}', "tokens"),
    ("/generate", b'{"input_ids": [1, 2], "session_id": 5}', "session_id"),
    ("/generate", b'{"input_ids": [[1, 2]]}', "batched"),
    ("/kvgate/probe", b'{"prompt_ids": "abc"}', "prompt_ids"),
    ("/kvgate/probe", b"", "empty"),
    ("/close_session", b"{}", "session_id"),
    ("/abort_request", b'{"rid": 3}', "rid"),
])
def test_bad_input_is_a_400_with_a_clear_message(one, path, body, needle):
    with client() as c:
        r = c.post(one.engine_urls[0] + path, content=body,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert needle in r.text


def test_process_mode_and_lean_client():
    with SimCluster(2, time_scale=0.0, process=True, **SMALL) as sim:
        async def run():
            pool = HttpPool(sim.router_url, 20.0)
            try:
                outs = await asyncio.gather(*(pool.post_json(
                    "/generate", {"input_ids": rand_ids(i, 64), "sampling_params": {"max_new_tokens": 3},
                                  "session_id": f"p{i}"}) for i in range(10)))
            finally:
                pool.close()
            return outs
        outs = asyncio.run(run())
        assert all(st == 200 and len(body["output_ids"]) == 3 for st, body in outs)
        assert sum(sim.stats(i)["total"]["num_requests"] for i in range(2)) == 10
        sim.stop_engine(1)
        with pytest.raises(httpx.ConnectError):
            httpx.get(sim.engine_urls[1] + "/health", trust_env=False)


def _check_accounting(s: RankScheduler) -> None:
    """Every lock and private block is owned by a running request; every pin by a session."""
    from collections import Counter
    refs: Counter = Counter()
    pins: Counter = Counter()
    private = 0
    for r in s.running.values():
        refs.update(r.hashes)
        private += r.held - len(r.hashes)
    for hs in s.sessions.values():
        pins.update(list(hs))
    assert private == s.cache.private_blocks
    for h, n in refs.items():
        assert s.cache.refcount(h) == n
    assert sum(1 for h in s.cache._ref if s.cache.refcount(h) > 0) == len(refs)
    for h, n in pins.items():
        assert s.cache.pincount(h) == n and s.cache.is_cached(h)
    assert s.remaining_decode_tokens() == sum(r.max_new - s.gen_of(r) for r in s.running.values())


@pytest.mark.parametrize("seed", range(6))
def test_random_workload_keeps_the_pool_consistent(seed):
    rnd = random.Random(seed)
    prof = load_profile(**dict(SMALL, kv_capacity_tokens=1600),
                        init_new_token_ratio=rnd.choice([0.05, 0.3, 0.7]))
    s = RankScheduler(prof, session_radix_cache=bool(seed % 2))
    hist = {k: rand_ids(1000 * seed + k, rnd.randrange(20, 200)) for k in range(6)}
    finished = []
    n = 0
    for step in range(3000):
        op = rnd.random()
        if op < 0.08 and len(s.by_rid) < 12:
            k = rnd.randrange(6)
            n += 1
            r = Req(f"q{n}", list(hist[k]), rnd.randrange(0, 120), session_id=f"s{k}",
                    on_done=finished.append)
            s.submit(r)
        elif op < 0.085 and s.by_rid:
            s.abort(rnd.choice(list(s.by_rid)))
        elif op < 0.10:
            s.close_session(f"s{rnd.randrange(6)}")
        it = s.begin_iteration()
        if it is not None:
            if rnd.random() < 0.01 and s.by_rid:       # abort while an iteration is in flight
                s.abort(rnd.choice(list(s.by_rid)))
            s.end_iteration(it)
        s.cache.check()
        _check_accounting(s)
        for r in finished:
            if r.finish_reason["type"] == "length" and r.session_id:
                k = int(r.session_id[1:])
                if len(hist[k]) < 900:
                    hist[k] = r.input_ids + r.output_ids + rand_ids(step, 10)
        finished.clear()
    _drain(s)            # session pins never block admission: everything drains
    assert s.num_queued == 0 and s.num_running == 0
    for k in range(6):
        s.close_session(f"s{k}")
    assert s.num_queued == 0 and s.num_running == 0
    assert s.cache.used_blocks == 0 and s.cache.private_blocks == 0
    assert s.num_requests + s.num_aborted == n
    print(f"seed {seed}: {s.num_requests} done, {s.num_aborted} aborted, "
          f"{s.retractions} retractions, {s.cache.evicted_blocks} evicted blocks")


def test_cli_rejects_an_unknown_profile_and_lists_the_available_ones():
    import subprocess
    import sys
    p = subprocess.run([sys.executable, "-m", "kvgate.tools.sim", "--profile", "nope", "--port", "0"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert "unknown simulator profile 'nope'" in p.stderr and "gpu-h100-30b" in p.stderr


def test_flush_cache_keeps_the_eviction_counter(fresh):
    url = fresh.engine_urls[0]
    with client() as c:
        for k in range(3):  # 3 x 960 distinct tokens through a 2,048-token pool: evicts
            gen(c, url, rand_ids(900 + k, 960), 4)
        before = metric(metrics(c, url), "kvgate_sim:evicted_tokens_total")
        assert before > 0
        assert c.post(url + "/flush_cache").status_code == 200
        # a Prometheus counter never goes back: the flush drops blocks, not what was evicted
        assert metric(metrics(c, url), "kvgate_sim:evicted_tokens_total") == before


def test_flush_cache_only_when_idle(fresh):
    url = fresh.engine_urls[0]
    with client() as c:
        p = rand_ids(70, 320)
        gen(c, url, p, 4)
        assert c.post(url + "/kvgate/probe", json={"prompt_ids": p}).json()["cached_blocks"] == 20
        r = c.post(url + "/flush_cache")
        assert r.status_code == 200 and r.text.startswith("Cache flushed.")
        assert c.post(url + "/kvgate/probe", json={"prompt_ids": p}).json()["cached_blocks"] == 0
        assert metric(metrics(c, url), "sglang:kv_available_tokens") == 2048
        assert metric(metrics(c, url), "sglang:prompt_tokens_total") == 320     # counters kept
    assert fresh.call(lambda: fresh.engines[0].ranks[0].submit(Req("busy", [1] * 20, 4))) is None
    with client() as c:   # a queued request (the driver was not woken) blocks the flush
        r = c.get(url + "/flush_cache")
        assert r.status_code == 400 and r.text.startswith("Cache not flushed.")
