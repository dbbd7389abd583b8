"""httpx clients that share one TLS context per process.

httpx builds a new ``ssl.SSLContext`` (loading the CA bundle) for every client it creates:
58 ms of CPU each on the project's 2-core box, against 0.1 ms with a context passed in. The
gate, the poller, the probe and the bench create clients inside running event loops (one per
probe loop, per poller run, per session close, per bench shard), where those milliseconds stall
every other coroutine. The context is built the way httpx builds its default
(``verify=True``; with ``trust_env``, ``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` are honoured), once
per ``trust_env`` value, so verification is unchanged.
"""
from __future__ import annotations

import functools
import ssl
from typing import Any

import httpx


#: how long kvgate keeps an idle connection to an engine: below uvicorn's 5 s keep-alive timeout
#: (vLLM's and SGLang's HTTP servers), which is also httpx's default expiry, so a request never
#: goes out on a connection the server is closing (that fails with ReadError: one real-vLLM
#: bench turn in 144, a session back from a ~5 s tool call)
ENGINE_KEEPALIVE_EXPIRY_S = 2.0


@functools.lru_cache(maxsize=2)
def tls_context(trust_env: bool = True) -> ssl.SSLContext:
    """The process's verifying TLS context (httpx's default one), built once per ``trust_env``."""
    return httpx.create_ssl_context(verify=True, trust_env=trust_env)


def async_client(**kw: Any) -> httpx.AsyncClient:
    """``httpx.AsyncClient(**kw)`` with the shared TLS context unless ``verify`` is given."""
    if "verify" not in kw:
        kw["verify"] = tls_context(bool(kw.get("trust_env", True)))
    return httpx.AsyncClient(**kw)


def sync_client(**kw: Any) -> httpx.Client:
    """``httpx.Client(**kw)`` with the shared TLS context unless ``verify`` is given."""
    if "verify" not in kw:
        kw["verify"] = tls_context(bool(kw.get("trust_env", True)))
    return httpx.Client(**kw)
