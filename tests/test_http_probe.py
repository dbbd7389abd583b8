"""HttpProbe against small real HTTP servers on loopback (no vLLM needed).

Each fake engine serves `POST /kvgate/probe` in the shared contract's shape, or misbehaves on purpose
(sleeps, garbage, HTTP errors).  The probe must take the best answer, skip the broken engines, stay
within its time bound, and turn total failure into hit_ratio=None.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvgate.integrations.http_probe import HttpProbe
from kvgate.client.probe import ProbeResult

from conftest import free_port

BLOCK = 16


class FakeEngine:
    """A loopback HTTP server answering /kvgate/probe; `mode` picks the behaviour."""

    def __init__(self, cached_blocks: int = 0, mode: str = "ok", delay_s: float = 0.0):
        self.cached_blocks = cached_blocks
        self.mode = mode
        self.delay_s = delay_s
        self.bodies: list[dict] = []
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def do_POST(self):  # noqa: N802
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    body = json.loads(raw)
                except ValueError:
                    body = None
                engine.bodies.append(body)
                if engine.delay_s:
                    time.sleep(engine.delay_s)
                status, payload = engine.answer(body)
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the client gave up (timeout test)
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def answer(self, body):
        if not isinstance(body, dict) or not isinstance(body.get("prompt_ids"), list):
            return 400, {"error": "bad body"}
        n = len(body["prompt_ids"])
        blocks = min(self.cached_blocks, n // BLOCK)
        good = {"cached_blocks": blocks, "cached_tokens": blocks * BLOCK, "total_blocks": n // BLOCK,
                "total_tokens": n, "hit_ratio": (blocks * BLOCK / n) if n else 0.0, "block_size": BLOCK,
                "engine": self.url}
        if self.mode == "ok":
            return 200, good
        if self.mode == "html":
            return 200, b"<html>not json</html>"
        if self.mode == "list":
            return 200, [good]
        if self.mode == "ratio":
            return 200, {**good, "hit_ratio": 1.7}
        if self.mode == "total":
            return 200, {**good, "total_tokens": n + 1}
        if self.mode == "missing":
            return 200, {"hit_ratio": 0.5}
        if self.mode == "err500":
            return 500, {"error": "boom"}
        raise AssertionError(self.mode)

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def engines():
    made: list[FakeEngine] = []

    def make(*a, **kw) -> FakeEngine:
        e = FakeEngine(*a, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def closed_port_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


PROMPT = list(range(100, 100 + 10 * BLOCK + 5))  # 10 full blocks + 5 tokens


def test_best_of_several_engines(engines):
    a, b, c = engines(0), engines(6), engines(3)
    with HttpProbe([a.url, b.url, c.url], timeout_s=2.0) as probe:
        r = probe.probe("s1", PROMPT)
    assert isinstance(r, ProbeResult)
    assert r.cached_blocks == 6 and r.cached_tokens == 6 * BLOCK
    assert r.total_tokens == len(PROMPT)
    assert r.hit_ratio == pytest.approx(6 * BLOCK / len(PROMPT))
    assert b.url in r.detail
    for e in (a, b, c):  # every engine was asked, with the prompt and the session id
        assert e.bodies == [{"prompt_ids": PROMPT, "session_id": "s1"}]


def test_async_best_of_several_engines(engines):
    a, b = engines(2), engines(9)

    async def main():
        async with HttpProbe([a.url, b.url], timeout_s=2.0) as probe:
            return await probe.aprobe("s1", PROMPT)

    r = asyncio.run(main())
    assert r.cached_blocks == 9 and b.url in r.detail


def test_timeout_skips_slow_engine_and_bounds_the_call(engines):
    fast, slow = engines(2), engines(10, delay_s=5.0)
    with HttpProbe([slow.url, fast.url], timeout_s=0.3) as probe:
        t0 = time.monotonic()
        r = probe.probe("s", PROMPT)
        took = time.monotonic() - t0
    assert r.cached_blocks == 2  # the slow engine's better answer never arrived
    assert "timeout" in r.detail and slow.url in r.detail
    assert took < 4.0  # bounded by timeout_s, far below the slow engine's 5 s
    print(f"\nslow engine: the probe answered from the fast one in {took:.2f} s (timeout_s=0.3)")


def test_async_timeout_everywhere_is_unavailable(engines):
    slow = engines(10, delay_s=5.0)

    async def main():
        async with HttpProbe([slow.url], timeout_s=0.3) as probe:
            t0 = time.monotonic()
            r = await probe.aprobe("s", PROMPT)
            return r, time.monotonic() - t0

    r, took = asyncio.run(main())
    assert r.hit_ratio is None and "timeout" in r.detail
    assert took < 4.0


@pytest.mark.parametrize("mode", ["html", "list", "ratio", "total", "missing", "err500"])
def test_garbage_answers_are_unavailable(engines, mode):
    bad = engines(4, mode=mode)
    with HttpProbe([bad.url], timeout_s=2.0) as probe:
        r = probe.probe("s", PROMPT)
    assert r.hit_ratio is None
    assert bad.url in r.detail


def test_garbage_engine_is_skipped_when_another_answers(engines):
    bad, good = engines(9, mode="ratio"), engines(1)
    with HttpProbe([bad.url, good.url], timeout_s=2.0) as probe:
        r = probe.probe("s", PROMPT)
    assert r.cached_blocks == 1 and "failed" in r.detail


def test_connection_refused_is_unavailable():
    with HttpProbe([closed_port_url()], timeout_s=1.0) as probe:
        r = probe.probe("s", PROMPT)
    assert r.hit_ratio is None and r.total_tokens == len(PROMPT)


def test_url_for_session_asks_only_that_engine(engines):
    a, b = engines(7), engines(3)
    owner = {"s-a": a.url, "s-b": [b.url]}
    with HttpProbe([a.url, b.url], url_for_session=owner.get, timeout_s=2.0) as probe:
        rb = probe.probe("s-b", PROMPT)
        assert rb.cached_blocks == 3 and a.bodies == []  # a was not asked
        r_unknown = probe.probe("s-x", PROMPT)  # no mapping: everyone, best answer
    assert r_unknown.cached_blocks == 7
    assert len(a.bodies) == 1 and len(b.bodies) == 2


def test_callable_url_source_is_read_per_probe(engines):
    a, b = engines(1), engines(5)
    current = [a.url]
    with HttpProbe(lambda: list(current), timeout_s=2.0) as probe:
        assert probe.probe("s", PROMPT).cached_blocks == 1
        current[:] = [a.url, b.url]
        assert probe.probe("s", PROMPT).cached_blocks == 5
        current[:] = []
        r = probe.probe("s", PROMPT)
    assert r.hit_ratio is None and "no engine" in r.detail


def test_broken_url_source_is_unavailable_not_an_exception():
    def boom():
        raise RuntimeError("redis down")

    with HttpProbe(boom, timeout_s=0.5) as probe:
        r = probe.probe("s", PROMPT)
    assert r.hit_ratio is None and "redis down" in r.detail


def test_empty_prompt_is_zero(engines):
    a = engines(3)
    with HttpProbe([a.url], timeout_s=2.0) as probe:
        r = probe.probe("s", [])
    assert r.hit_ratio == 0.0 and r.total_tokens == 0


@pytest.mark.parametrize("ids", ["abc", [1, "2"], [1, True], [-1], [1.5], None, 7])
def test_bad_prompt_ids_raise_before_any_request(engines, ids):
    a = engines(3)
    with HttpProbe([a.url], timeout_s=1.0) as probe:
        with pytest.raises(ValueError):
            probe.probe("s", ids)

        async def main():
            with pytest.raises(ValueError):
                await probe.aprobe("s", ids)

        asyncio.run(main())
    assert a.bodies == []


def test_bad_session_and_constructor_arguments(engines):
    a = engines(0)
    with HttpProbe([a.url]) as probe:
        with pytest.raises(ValueError):
            probe.probe(42, [1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        HttpProbe()
    with pytest.raises(ValueError):
        HttpProbe(["engine-without-scheme:8000"])
    with pytest.raises(ValueError):
        HttpProbe([a.url], timeout_s=0)
    with pytest.raises(ValueError):
        HttpProbe([a.url], path="kvgate/client/probe")
    assert a.bodies == []


# ------------------------------------------------------------------ the plugin's routes, without vLLM
class StandInEngineCore:
    """Stands in for vLLM's async engine-core client (the real one is exercised in test_vllm_real.py):
    `core_engines` data-parallel ranks, each holding `blocks[i]` leading blocks of every prompt."""

    def __init__(self, blocks: list[int], delay_s: float = 0.0, fail: bool = False):
        self.core_engines = list(range(len(blocks)))
        self.blocks = blocks
        self.delay_s = delay_s
        self.fail = fail
        self.calls: list[tuple] = []

    async def _one(self, rank: int, method: str, *args):
        self.calls.append((rank, method, args))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.fail:
            raise Exception(f"Call to {method} method failed: 'EngineCore' object has no attribute '{method}'")
        if method == "kvgate_usage":
            return {"usage": 0.1 * (rank + 1), "num_gpu_blocks": 100, "num_free_blocks": 90 - rank,
                    "block_size": BLOCK, "engine": f"dp{rank}"}
        ids = args[0]
        n, cb = len(ids), min(self.blocks[rank], len(ids) // BLOCK)
        return {"cached_blocks": cb, "cached_tokens": cb * BLOCK, "total_blocks": n // BLOCK, "total_tokens": n,
                "hit_ratio": cb * BLOCK / n if n else 0.0, "block_size": BLOCK, "engine": f"dp{rank}"}

    async def call_utility_async(self, method: str, *args):
        return await self._one(0, method, *args)

    async def call_utility_all_async(self, method: str, *args):
        return await asyncio.gather(*[self._one(r, method, *args) for r in self.core_engines])


class RouteServer:
    """The plugin's routes on a Starlette app served by uvicorn on loopback (in a thread)."""

    def __init__(self, core: StandInEngineCore, token: str | None = None, timeout_s: float = 5.0):
        import uvicorn
        from starlette.applications import Starlette

        from kvgate.integrations.vllm_plugin import KvgateEndpointPlugin

        app = Starlette()
        plugin = KvgateEndpointPlugin(timeout_s=timeout_s, token=token)
        plugin.attach_router(app)
        asyncio.run(plugin.init_state(type("EC", (), {"engine_core": core})(), app.state, None))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error",
                                                    lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture
def route_server():
    made: list[RouteServer] = []

    def make(*a, **kw) -> RouteServer:
        s = RouteServer(*a, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def test_route_asks_every_dp_rank_and_answers_with_the_best(route_server):
    import httpx
    core = StandInEngineCore([2, 8, 5])
    srv = route_server(core)
    r = httpx.post(srv.url + "/kvgate/probe", json={"prompt_ids": PROMPT, "session_id": "s"}, timeout=5)
    assert r.status_code == 200
    body = r.json()
    assert (body["cached_blocks"], body["engine"], body["total_blocks"]) == (8, "dp1", 10)
    assert sorted(c[0] for c in core.calls) == [0, 1, 2]
    u = httpx.get(srv.url + "/kvgate/usage", timeout=5).json()
    assert u["usage"] == pytest.approx(0.3) and u["engine"] == "dp2" and len(u["engines"]) == 3
    with HttpProbe([srv.url], timeout_s=2.0) as probe:
        assert probe.probe("s", PROMPT).cached_blocks == 8


@pytest.mark.parametrize("body", [b"not json", b"[1]", b"{}", b'{"prompt_ids": [1, -1]}',
                                  b'{"prompt_ids": [true]}', b'{"prompt_ids": [1], "session_id": 3}',
                                  b'{"prompt_ids": [1], "cache_salt": 3}'])
def test_route_rejects_bad_bodies_without_asking_the_engine(route_server, body):
    import httpx
    core = StandInEngineCore([1])
    srv = route_server(core)
    r = httpx.post(srv.url + "/kvgate/probe", content=body, timeout=5)
    assert r.status_code == 400 and "error" in r.json()
    assert core.calls == []


def test_route_engine_failures_and_timeouts(route_server):
    import httpx
    broken = route_server(StandInEngineCore([1], fail=True))
    r = httpx.post(broken.url + "/kvgate/probe", json={"prompt_ids": PROMPT}, timeout=5)
    assert r.status_code == 500 and "VLLM_PLUGINS" in r.json()["error"]
    slow = route_server(StandInEngineCore([1], delay_s=3.0), timeout_s=0.2)
    r = httpx.post(slow.url + "/kvgate/probe", json={"prompt_ids": PROMPT}, timeout=5)
    assert r.status_code == 504
    with HttpProbe([broken.url, slow.url], timeout_s=2.0) as probe:
        res = probe.probe("s", PROMPT)
    assert res.hit_ratio is None and "HTTP 500" in res.detail and "HTTP 504" in res.detail


def test_route_token(route_server):
    import httpx
    srv = route_server(StandInEngineCore([4]), token="s3cret")
    assert httpx.post(srv.url + "/kvgate/probe", json={"prompt_ids": PROMPT}, timeout=5).status_code == 401
    assert httpx.get(srv.url + "/kvgate/usage", timeout=5).status_code == 401
    with HttpProbe([srv.url], timeout_s=2.0, headers={"Authorization": "Bearer s3cret"}) as probe:
        assert probe.probe("s", PROMPT).cached_blocks == 4
    with HttpProbe([srv.url], timeout_s=2.0, headers={"Authorization": "Bearer wrong"}) as probe:
        assert probe.probe("s", PROMPT).hit_ratio is None


def test_async_url_sources_are_awaited_by_aprobe(engines):
    a, b = engines(2), engines(6)

    async def urls():  # like AsyncGate.engine_urls
        return [a.url, b.url]

    async def owner(sid):
        return a.url if sid == "s-a" else None

    async def main():
        async with HttpProbe(urls, url_for_session=owner, timeout_s=2.0) as probe:
            return await probe.aprobe("s-a", PROMPT), await probe.aprobe("s-x", PROMPT)

    ra, rx = asyncio.run(main())
    assert ra.cached_blocks == 2 and rx.cached_blocks == 6
    with HttpProbe(urls, timeout_s=2.0) as probe:  # sync probe() cannot await: unavailable, says why
        r = probe.probe("s", PROMPT)
    assert r.hit_ratio is None and "aprobe" in r.detail


# -- what a probe refuses, cuts short or drops, and what it still answers ---------------------------
def test_one_engine_with_an_unusable_url_does_not_discard_the_others(engines):
    # httpx.InvalidURL (port out of range) is not an httpx.HTTPError: it used to escape the
    # worker and fail the whole probe, dropping the good engine's answer
    good = engines(6)
    # a dynamic source (a static list is checked when the probe is made, below)
    with HttpProbe(lambda: [good.url, "http://127.0.0.1:99999"], timeout_s=2.0) as probe:
        res = probe.probe("s", PROMPT)

        async def go():
            return await probe.aprobe("s", PROMPT)

        ares = asyncio.run(go())
    for r in (res, ares):
        assert r.cached_blocks == 6 and "127.0.0.1:99999" in r.detail


def test_leading_hit_allows_the_block_eagle_drops():
    from kvgate.integrations.vllm_plugin import leading_hit
    bs, total = 16, 64 * 16
    looked: list[int] = []

    def eagle_engine(upto):  # everything cached; EAGLE/MTP drops the last matched block
        looked.append(upto)
        return upto - bs

    assert leading_hit(eagle_engine, lambda a, b: None, total, 8 * bs, bs) == total - bs
    assert looked == [128, 256, 512, 1024]  # chunks of 8, 16, 32, 64 blocks
    looked.clear()

    def cold_after_3(upto):
        looked.append(upto)
        return min(upto, 3 * bs)

    assert leading_hit(cold_after_3, lambda a, b: None, total, 8 * bs, bs) == 3 * bs
    assert looked == [128]  # a cold prompt costs one small chunk


def test_probe_of_an_engine_without_prefix_caching_is_unavailable_not_cold():
    from types import SimpleNamespace

    from kvgate.integrations.vllm_plugin import kvgate_probe
    cfg = SimpleNamespace(cache_config=SimpleNamespace(block_size=16),
                          parallel_config=SimpleNamespace(data_parallel_rank=0))
    off = SimpleNamespace(scheduler=SimpleNamespace(kv_cache_manager=SimpleNamespace(enable_caching=False)),
                          request_block_hasher=None, vllm_config=cfg)
    with pytest.raises(RuntimeError, match="prefix caching is off"):
        kvgate_probe(off, list(range(64)))


def test_register_routes_with_an_app_reads_the_token_and_timeout(monkeypatch, caplog):
    from starlette.applications import Starlette
    from starlette.testclient import TestClient

    from kvgate.integrations import vllm_plugin as vp
    monkeypatch.setenv(vp.TOKEN_ENV, "s3cret")
    app = Starlette()
    assert vp.register_routes(app) is None
    with TestClient(app) as c:
        assert c.post("/kvgate/probe", json={"prompt_ids": [1, 2]}).status_code == 401
        assert c.get("/kvgate/usage").status_code == 401
    # a route timeout that is not a number of seconds: a warning and 5 s, never a failed start-up
    for raw in ("inf", "0", "-3", "soon", "nan"):
        monkeypatch.setenv(vp.SERVER_TIMEOUT_ENV, raw)
        with caplog.at_level("WARNING", logger=vp.logger.name):
            assert vp.KvgateEndpointPlugin().timeout_s == 5.0
        assert vp.SERVER_TIMEOUT_ENV in caplog.text
    monkeypatch.setenv(vp.SERVER_TIMEOUT_ENV, "2.5")
    assert vp.KvgateEndpointPlugin().timeout_s == 2.5
    with pytest.raises(ValueError, match="route timeout"):
        vp.KvgateEndpointPlugin(timeout_s=0)


def test_in_process_usage_on_the_engines_own_loop_fails_fast():
    from kvgate.integrations.vllm import InProcessVllmProbe

    async def go():
        probe = InProcessVllmProbe(StandInEngineCore([1]), timeout_s=0.5, loop=asyncio.get_running_loop())
        with pytest.raises(RuntimeError, match="own event loop"):
            probe.usage()  # blocking here would stall the loop that must answer it
        return await probe.ausage()

    assert asyncio.run(go())["engine"] == "dp0"


@pytest.mark.parametrize("bad", ["http://127.0.0.1:99999", "http://10.0.0.5:8000@x", "http://h:8000#x",
                                 "http://h:8000/?a=1", "http://", "ftp://h:1", "http://u:secret@h:8000"])
def test_a_static_url_that_is_no_engine_base_url_is_an_error_at_once(bad):
    # a fragment or query used to become part of the request URL (the POST went to "/"), and
    # "h:8000@x" sent the probe to host "x" with "h:8000" as Basic auth
    with pytest.raises(ValueError):
        HttpProbe([bad])


def test_a_router_dp_suffix_is_dropped_from_the_probed_url():
    assert HttpProbe(["http://10.0.0.5:8000@3"])._urls == ["http://10.0.0.5:8000"]


def _serve(handler_cls):
    import http.server
    import threading
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler_cls)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def test_an_endless_answer_is_cut_at_the_cap_and_the_deadline():
    # httpx's timeouts are per chunk: an engine streaming forever kept a probe thread reading
    # (and its memory growing) long after the probe answered "timeout"
    import http.server
    import threading
    stop = threading.Event()
    sent = []

    class Endless(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            try:
                while not stop.is_set():
                    chunk = b"[" + b"1," * 4000
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    sent.append(len(chunk))
            except OSError:
                pass

        def log_message(self, *a):
            pass

    srv = _serve(Endless)
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        with HttpProbe([url], timeout_s=2.0) as probe:
            res = probe.probe("s", PROMPT)
            assert res.hit_ratio is None and "answer too large" in res.detail
            n_sync = len(sent)

            async def go():
                return await probe.aprobe("s", PROMPT)
            ares = asyncio.run(go())
            assert ares.hit_ratio is None and "answer too large" in ares.detail
        # the reader stopped at the cap: the server could not push much past 64 KiB (the
        # socket buffers hold some), where before it streamed until the test ended
        assert sum(sent[:n_sync]) < 64 * 1024 * 64
    finally:
        stop.set()
        srv.shutdown()


def test_a_compressed_answer_is_refused_unread():
    import gzip
    import http.server

    bomb = gzip.compress(b" " * (50 * 1024 * 1024))

    class Gzip(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Encoding", "gzip")
            self.send_header("Content-Length", str(len(bomb)))
            self.end_headers()
            self.wfile.write(bomb)

        def log_message(self, *a):
            pass

    srv = _serve(Gzip)
    try:
        with HttpProbe([f"http://127.0.0.1:{srv.server_address[1]}"], timeout_s=2.0) as probe:
            res = probe.probe("s", PROMPT)
        assert res.hit_ratio is None and "compressed answer (gzip)" in res.detail
    finally:
        srv.shutdown()


def test_the_probe_ignores_proxy_settings(engines, monkeypatch):
    # every other engine client of kvgate asks engines directly; an HTTP_PROXY meant for the
    # internet broke the probe (and would have received the prompt ids)
    good = engines(6)
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    with HttpProbe([good.url], timeout_s=2.0) as probe:
        assert probe.probe("s", PROMPT).cached_blocks == 6
