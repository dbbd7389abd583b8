"""Engine base URLs: one check, shared by discovery, snapshots, the config and the close
fan-out (no I/O, so the config can import it)."""
from __future__ import annotations

import re
from urllib.parse import urlsplit

_DP_SUFFIX = re.compile(r"@(\d+)$")  # sgl-router --dp-aware lists "http://h:p@<dp_rank>"


def normalize_base_url(url: str) -> str:
    """``http(s)://host[:port][/prefix]`` without a trailing slash or a router ``@dp`` suffix.

    Raises ValueError for anything else (no scheme, other schemes, no host, query strings,
    credentials, whitespace or control characters). The host is lower-cased, so one engine
    written two ways is one engine (one close, one probe).
    """
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"engine URL must be a non-empty string, got {url!r}")
    u = _DP_SUFFIX.sub("", url.strip())
    if any(ord(c) <= 32 or ord(c) == 127 for c in u):
        raise ValueError(f"engine URL must not contain whitespace or control characters: {url!r}")
    parts = urlsplit(u)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"engine URL needs an http:// or https:// scheme: {url!r}")
    if not parts.hostname:
        raise ValueError(f"engine URL has no host: {url!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"engine URL must not carry a query or fragment: {url!r}")
    if "@" in parts.netloc:
        # "h:8000@x" is host x with "h:8000" as credentials; engines take none, and a URL
        # with a secret in it would land in logs and close errors
        raise ValueError(f"engine URL must not carry credentials (user@host): {url!r}")
    try:
        parts.port  # noqa: B018 - validates the port
    except ValueError as e:
        raise ValueError(f"engine URL has a bad port ({e}): {url!r}") from e
    return f"{parts.scheme}://{parts.netloc.lower()}{parts.path}".rstrip("/")
