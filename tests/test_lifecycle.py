"""Session KV lifecycle: session ids on /generate and the /close_session fan-out."""
from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from kvgate.client.lifecycle import CloseResult, aclose_session, close_session, with_session_id
from _httphelpers import FakeHTTP, RefusedPort, Reply, hang, html


def test_with_session_id_copies():
    p = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 8}}
    q = with_session_id(p, "s-1")
    assert q == {**p, "session_id": "s-1"} and "session_id" not in p
    assert with_session_id(q, "s-1") == q  # same id again is fine
    with pytest.raises(ValueError):
        with_session_id(q, "s-2")
    for bad in ("", None, 5):
        with pytest.raises(ValueError):
            with_session_id(p, bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        with_session_id([1], "s")  # type: ignore[arg-type]


class CloseEngine(FakeHTTP):
    """An engine that records which sessions it was asked to close."""

    def __init__(self, reply: Reply | None = None):
        super().__init__()
        self.closed: list[str] = []
        self.lock = threading.Lock()

        def on_close(body: bytes) -> Reply:
            with self.lock:
                self.closed.append(json.loads(body)["session_id"])
            return reply or Reply(200, b"", "text/plain")

        self.route("POST", "/close_session", on_close)


@pytest.fixture
def engines():
    es = [CloseEngine().start() for _ in range(3)]
    yield es
    for e in es:
        e.stop()


def test_close_fans_out_to_every_engine(engines):
    urls = [e.url for e in engines] + [engines[0].url + "/"]  # duplicate collapses
    res = asyncio.run(aclose_session(urls, "sess-7"))
    assert res == CloseResult(3, 0, ())
    assert res.ok
    assert [e.closed for e in engines] == [["sess-7"]] * 3


def test_close_counts_failures_never_raises(engines):
    engines[1].route("POST", "/close_session", html(500))
    with RefusedPort() as refused:  # held: nothing else can answer on it
        dead = refused.url
        res = close_session([engines[0].url, engines[1].url, dead, engines[2].url], "s", timeout_s=1.0)
    assert res.attempts == 4 and res.failures == 2 and not res.ok
    assert any("500" in e for e in res.errors)
    assert any(dead in e for e in res.errors)
    assert engines[0].closed == ["s"] and engines[2].closed == ["s"]


def test_close_hanging_engine_is_bounded(engines):
    engines[0].route("POST", "/close_session", hang(30))
    res = close_session([e.url for e in engines], "s", timeout_s=0.3, concurrency=1)
    assert (res.attempts, res.failures) == (3, 1)
    assert "timed out" in res.errors[0]


@pytest.mark.parametrize("in_loop", [False, True], ids=["no-loop", "in-loop"])
def test_sync_close_is_bounded_when_a_name_lookup_hangs(monkeypatch, in_loop):
    # the request's deadline cancels the lookup's await, but the lookup itself keeps running
    # in asyncio's default executor, which asyncio.run joins on its way out: the close must
    # return within its bound without joining it (before, it waited for the lookup)
    import socket

    real = socket.getaddrinfo
    started, release, finished = threading.Event(), threading.Event(), threading.Event()

    def getaddrinfo(host, *a, **k):
        if host in ("hung-lookup.invalid", b"hung-lookup.invalid"):  # anyio passes IDNA bytes
            started.set()
            release.wait(60)  # bounded, so a regression fails instead of hanging the suite
            finished.set()
            raise socket.gaierror(socket.EAI_NONAME, "released by the test")
        return real(host, *a, **k)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)

    async def in_a_loop():
        return close_session(["http://hung-lookup.invalid:1"], "s", timeout_s=0.2)

    try:
        res = (asyncio.run(in_a_loop()) if in_loop
               else close_session(["http://hung-lookup.invalid:1"], "s", timeout_s=0.2))
        assert started.is_set()
        assert not finished.is_set(), "close_session waited for the hung lookup"
        assert (res.attempts, res.failures) == (1, 1) and not res.ok
        assert "close fan-out failed" in res.errors[0]
    finally:
        release.set()


def test_close_with_caller_client_and_no_urls(engines):
    async def go():
        async with httpx.AsyncClient(trust_env=False) as c:
            r1 = await aclose_session([engines[2].url], "a", client=c)
            r2 = await aclose_session([], "b", client=c)
            return r1, r2

    r1, r2 = asyncio.run(go())
    assert (r1.attempts, r1.failures) == (1, 0) and (r2.attempts, r2.failures) == (0, 0)


def test_sync_close_inside_running_loop(engines):
    async def go():
        return close_session([e.url for e in engines], "in-loop")

    res = asyncio.run(go())
    assert (res.attempts, res.failures) == (3, 0)


@pytest.mark.parametrize("kw", [
    {"session_id": ""}, {"timeout_s": 0}, {"concurrency": 0}, {"urls": ["no-scheme:1"]},
])
def test_bad_arguments_before_any_request(engines, kw):
    args = {"urls": [engines[0].url], "session_id": "s", **kw}
    urls = args.pop("urls")
    sid = args.pop("session_id")
    with pytest.raises(ValueError):
        close_session(urls, sid, **args)
    with pytest.raises(ValueError):
        asyncio.run(aclose_session(urls, sid, **args))
    assert engines[0].closed == []


# -- end to end against the SGLang simulator --------------------------------------------------
def _sim_gauge(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    body = httpx.get(url + "/metrics", timeout=5, trust_env=False).text
    vals = [s.value for f in text_string_to_metric_families(body) for s in f.samples if s.name == name]
    assert vals, f"{name} missing from {url}/metrics"
    return max(vals)


@pytest.mark.redis_real
def test_finish_session_frees_kv_on_live_engines_and_counts_the_dead_one(redis_url):
    sim = pytest.importorskip("kvgate.tools.sim")
    import kvgate
    from kvgate.control.poller import Poller

    with sim.SimCluster(3, router=True, session_radix_cache=True, time_scale=0.01) as c:
        gate = kvgate.Gate.from_url(redis_url, gate="life", config=kvgate.GateConfig(
            session_lifecycle=True, close_timeout_s=1.0))
        assert Poller(gate, router=c.router_url).tick().wrote
        assert gate.engine_urls() == sorted(c.engine_urls)
        sid = "agent-42"
        prompt = list(range(1, 513))
        with httpx.Client(trust_env=False, timeout=30) as http:
            for url in c.engine_urls:  # one turn of the session on every engine
                with gate.turn(sid, prompt_ids=prompt, max_new_tokens=8) as lease:
                    assert lease.outcome == "admit"
                    payload = with_session_id({"input_ids": prompt, "sampling_params": {"max_new_tokens": 8}}, sid)
                    r = http.post(url + "/generate", json=payload)
                    assert r.status_code == 200, r.text
        for url in c.engine_urls:
            assert _sim_gauge(url, "kvgate_sim:open_sessions") == 1  # the session pins its KV
        pinned_before = [_sim_gauge(u, "kvgate_sim:session_pinned_tokens") for u in c.engine_urls[:2]]
        assert all(p > 0 for p in pinned_before)  # each live engine holds one turn of the session
        c.stop_engine(2)
        out = gate.finish_session(sid)
        assert out["close"] == {"attempts": 3, "failures": 1}
        for url in c.engine_urls[:2]:
            assert _sim_gauge(url, "kvgate_sim:open_sessions") == 0
            # back in the first eviction tier (it counted as evictable before too, as in SGLang)
            assert _sim_gauge(url, "kvgate_sim:session_pinned_tokens") == 0
        m = gate.step_metrics()
        assert m["agentic_kv/session/close"] == 3 and m["agentic_kv/session/close_failure"] == 1
        # closing again is harmless (idempotent on the engines)
        assert gate.finish_session(sid)["close"] == {"attempts": 3, "failures": 1}


# -- a close that goes nowhere is a failed close --------------------------------------------
def _nowhere_gates(snapshot: str):
    """A sync and an async gate (one fake Redis) with lifecycle on, no static engine_urls, and
    either no snapshot or one whose engines carry no URL."""
    import fakeredis

    import kvgate
    cfg = kvgate.GateConfig(session_lifecycle=True, close_timeout_s=0.5)
    server = fakeredis.FakeServer()
    g = kvgate.Gate(fakeredis.FakeRedis(server=server), gate="g", config=cfg)
    ag = kvgate.AsyncGate(fakeredis.FakeAsyncRedis(server=server), gate="g", config=cfg)
    if snapshot == "no-urls":
        g.write_snapshot([kvgate.EngineState("e1", capacity_tokens=10_000, usage=0.1)])
    return g, ag


@pytest.mark.parametrize("snapshot", ["none", "no-urls"])
def test_a_close_with_no_engine_to_go_to_counts_as_one_failure(snapshot, caplog):
    import logging
    g, ag = _nowhere_gates(snapshot)
    with caplog.at_level(logging.WARNING, logger="kvgate"):
        out = g.finish_session("s1")
        assert out["close"] == {"attempts": 1, "failures": 1}
        again = g.finish_session("s2")  # counted again, not logged again (rate-limited)
        assert again["close"] == {"attempts": 1, "failures": 1}

        async def run():
            try:
                return await ag.finish_session("s3")
            finally:
                await ag.aclose()
        assert asyncio.run(run())["close"] == {"attempts": 1, "failures": 1}
    m = g.step_metrics()
    assert m["agentic_kv/session/close"] == 3 and m["agentic_kv/session/close_failure"] == 3
    warned = [r for r in caplog.records if r.name.startswith("kvgate") and r.levelno == logging.WARNING
              and "close" in r.getMessage()]
    assert len(warned) == 2, [r.getMessage() for r in warned]  # once per gate object
    assert "engine" in warned[0].getMessage()
    g.close()
