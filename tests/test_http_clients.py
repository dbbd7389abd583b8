"""kvgate's httpx clients share one verifying TLS context (kvgate/_http.py)."""
from __future__ import annotations

import asyncio
import ssl

import httpx

from kvgate._http import async_client, sync_client, tls_context
from kvgate.integrations.http_probe import HttpProbe


def _ctx(client) -> ssl.SSLContext:
    return client._transport._pool._ssl_context  # httpcore's pool keeps the context it was given


def test_the_context_is_built_once_and_verifies():
    a, b = tls_context(False), tls_context(False)
    assert a is b
    assert a.verify_mode == ssl.CERT_REQUIRED and a.check_hostname
    assert tls_context(True).verify_mode == ssl.CERT_REQUIRED


def test_clients_share_it_unless_verify_is_given():
    c1, c2 = sync_client(trust_env=False), sync_client(trust_env=False)
    try:
        assert _ctx(c1) is _ctx(c2) is tls_context(False)
    finally:
        c1.close()
        c2.close()
    own = sync_client(verify=False)
    try:
        assert _ctx(own) is not tls_context(True)
        assert _ctx(own).verify_mode == ssl.CERT_NONE
    finally:
        own.close()

    async def make() -> tuple:
        a = async_client(trust_env=False)
        try:
            return _ctx(a), isinstance(a, httpx.AsyncClient)
        finally:
            await a.aclose()
    ctx, is_async = asyncio.run(make())
    assert is_async and ctx is tls_context(False)


def test_the_http_probe_uses_the_shared_context():
    p = HttpProbe(["http://127.0.0.1:9"], timeout_s=0.2)
    try:
        # the engines' context (trust_env=False, as every engine client of kvgate), shared
        assert _ctx(p._sync_client()) is tls_context(False)
    finally:
        p.close()


def test_engine_connections_expire_before_uvicorns_keep_alive():
    # uvicorn (vLLM's and SGLang's servers) drops a connection idle for 5 s, which is also
    # httpx's default expiry: a turn or a probe sent on a connection the server is closing
    # fails with ReadError (seen once in a real-vLLM bench run). Both clients expire idle
    # connections well before that.
    from kvgate.tools.bench.engines import make_client

    def expiry(client) -> float:
        return client._transport._pool._keepalive_expiry

    async def main() -> tuple:
        c = make_client("vllm", ["http://127.0.0.1:9"], ["http://127.0.0.1:9"])
        p = HttpProbe(["http://127.0.0.1:9"])
        try:
            return expiry(c.http_for("s1")), expiry(p._async_client())
        finally:
            await c.aclose()
            await p.aclose()
    bench, probe = asyncio.run(main())
    assert bench < 5.0 and probe < 5.0
