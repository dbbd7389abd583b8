"""Discovery against real loopback HTTP servers posing as sgl-router / engines."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from kvgate.control.discovery import (
    BodyTooLarge,
    Discovery,
    DiscoveryError,
    HttpError,
    fetch_limited,
    normalize_base_url,
    parse_workers,
)
from _httphelpers import FakeHTTP, RefusedPort, hang, html, huge, js, text


@pytest.fixture
def srv():
    s = FakeHTTP().start()
    yield s
    s.stop()


def run(coro):
    return asyncio.run(coro)


async def _discover(d: Discovery):
    async with httpx.AsyncClient(trust_env=False) as c:
        return await d.discover(c)


def test_normalize_base_url():
    assert normalize_base_url("http://h:30000/") == "http://h:30000"
    assert normalize_base_url(" https://h/prefix/ ") == "https://h/prefix"
    assert normalize_base_url("http://10.0.0.1:30000@3") == "http://10.0.0.1:30000"
    for bad in ["", "h:30000", "ftp://h", "http://", "http://h:99999", "http://h/?x=1", None, 3]:
        with pytest.raises(ValueError):
            normalize_base_url(bad)  # type: ignore[arg-type]


def test_router_workers_keeps_health(srv):
    srv.route("GET", "/workers", js({"workers": [
        {"id": "w1", "url": "http://127.0.0.1:1001", "model_id": "m", "worker_type": "regular",
         "is_healthy": True, "load": 3},
        {"id": "w2", "url": "http://127.0.0.1:1002", "model_id": "m", "worker_type": "regular",
         "is_healthy": False, "load": 0},
        {"id": "w3", "url": "http://127.0.0.1:1003/", "is_healthy": True, "draining": True},
        {"url": "not a url", "is_healthy": True},
    ], "total": 4, "stats": {"regular_count": 4}}))
    eps = run(_discover(Discovery(router=srv.url)))
    by = {e.url: e for e in eps}
    assert set(by) == {"http://127.0.0.1:1001", "http://127.0.0.1:1002", "http://127.0.0.1:1003"}
    assert by["http://127.0.0.1:1001"].healthy and by["http://127.0.0.1:1001"].model_id == "m"
    assert not by["http://127.0.0.1:1002"].healthy
    assert not by["http://127.0.0.1:1003"].healthy and by["http://127.0.0.1:1003"].draining
    assert all(e.source == "workers" for e in eps)


def test_router_dp_aware_entries_collapse(srv):
    srv.route("GET", "/workers", js({"workers": [
        {"url": "http://127.0.0.1:1001@0", "is_healthy": False},
        {"url": "http://127.0.0.1:1001@1", "is_healthy": True},
    ]}))
    (ep,) = run(_discover(Discovery(router=srv.url)))
    assert ep.url == "http://127.0.0.1:1001" and ep.healthy


def test_router_falls_back_to_list_workers(srv):
    srv.route("GET", "/list_workers", js({"urls": ["http://127.0.0.1:1001", "http://127.0.0.1:1002",
                                                   "http://127.0.0.1:1001/"]}))
    d = Discovery(router=srv.url)
    eps = run(_discover(d))
    assert [e.url for e in eps] == ["http://127.0.0.1:1001", "http://127.0.0.1:1002"]
    assert d.last_source == "list_workers" and all(e.healthy for e in eps)
    assert [r[1] for r in srv.requests] == ["/workers", "/list_workers"]


def test_router_workers_html_falls_back(srv):
    srv.route("GET", "/workers", html())
    srv.route("GET", "/list_workers", js({"urls": ["http://127.0.0.1:1001"]}))
    assert [e.url for e in run(_discover(Discovery(router=srv.url)))] == ["http://127.0.0.1:1001"]


def test_router_unusable_raises(srv):
    srv.route("GET", "/workers", js({"nope": 1}))
    srv.route("GET", "/list_workers", html(502))
    with pytest.raises(DiscoveryError, match="unusable"):
        run(_discover(Discovery(router=srv.url)))


def test_router_unreachable_raises():
    with RefusedPort() as dead, pytest.raises(DiscoveryError):
        run(_discover(Discovery(router=dead.url, timeout_s=0.5)))


def test_router_hanging_is_bounded(srv):
    srv.route("GET", "/workers", hang(30))
    srv.route("GET", "/list_workers", hang(30))
    with pytest.raises(DiscoveryError, match="timed out"):
        run(_discover(Discovery(router=srv.url, timeout_s=0.3)))


def test_static_list():
    d = Discovery(engines=["http://127.0.0.1:1/", "http://127.0.0.1:1", "http://127.0.0.1:2"])
    assert [e.url for e in run(_discover(d))] == ["http://127.0.0.1:1", "http://127.0.0.1:2"]


@pytest.mark.parametrize("kw", [
    {}, {"router": "http://r", "engines": ["http://e"]}, {"engines": []},
    {"engines": ["nope"]}, {"router": "http://r", "timeout_s": 0}, {"router": "http://r", "max_body_bytes": 0},
])
def test_bad_arguments(kw):
    with pytest.raises(ValueError):
        Discovery(**kw)


def test_parse_workers_shapes():
    with pytest.raises(ValueError):
        parse_workers([], source="workers")
    with pytest.raises(ValueError):
        parse_workers({"workers": {}}, source="workers")
    with pytest.raises(ValueError):
        parse_workers({"urls": "x"}, source="list_workers")
    assert parse_workers({"workers": [1, "x", {"url": "http://h:1"}]}, source="workers")[0].healthy


def test_fetch_limited_size_cap(srv):
    srv.route("GET", "/big", huge(5_000_000))
    srv.route("GET", "/declared", text("x" * 5000))
    srv.route("GET", "/ok", text("fine"))

    async def go():
        async with httpx.AsyncClient(trust_env=False) as c:
            with pytest.raises(BodyTooLarge):
                await fetch_limited(c, srv.url + "/big", timeout_s=5, max_body_bytes=100_000)
            with pytest.raises(BodyTooLarge):
                await fetch_limited(c, srv.url + "/declared", timeout_s=5, max_body_bytes=1000)
            with pytest.raises(HttpError, match="404"):
                await fetch_limited(c, srv.url + "/missing", timeout_s=5)
            assert await fetch_limited(c, srv.url + "/ok", timeout_s=5) == b"fine"

    run(go())


def test_one_engine_written_two_ways_is_one_engine():
    from kvgate._urls import normalize_base_url
    from kvgate.control.discovery import dedupe_urls
    assert dedupe_urls(["http://E1:8000", "http://e1:8000/", "http://e1:8000@2"]) == ["http://e1:8000"]
    assert normalize_base_url("https://Host.Example:443/V1/") == "https://host.example:443/V1"  # path keeps its case


@pytest.mark.parametrize("bad", ["http://e1\n:8000", "http://e 1:8000", "http://user:secret@e1:8000",
                                 "http://10.0.0.5:8000@x"])
def test_credentials_and_control_characters_are_no_engine_url(bad):
    from kvgate._urls import normalize_base_url
    with pytest.raises(ValueError):
        normalize_base_url(bad)
