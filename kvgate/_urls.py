"""The URLs kvgate reads itself, without I/O (so the config can import it): engine base URLs
(one check, shared by discovery, snapshots, the config and the close fan-out) and Redis
Sentinel URLs (one parser, shared by both gates' ``from_url``, the poller and the CLI)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

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


# -- Redis through Sentinel ------------------------------------------------------------------
#: the schemes of a Sentinel URL: the data nodes' connections plain, or over TLS
SENTINEL_SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}
#: the port of a sentinel written without one (Sentinel's own default)
SENTINEL_PORT = 26379
#: query keys a Sentinel URL may carry: the database, the sentinels' own credentials, and the
#: TLS files of the data nodes (as a ``rediss://`` URL names them)
_SENTINEL_QUERY = {"db", "sentinel_username", "sentinel_password",
                   "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs"}


@dataclass(frozen=True)
class SentinelURL:
    """A parsed ``redis+sentinel://`` URL: what ``redis.sentinel.Sentinel(...).master_for``
    takes. ``master_kwargs`` go to the data nodes (the primary), ``sentinel_kwargs`` to the
    sentinels."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    master_kwargs: dict = field(default_factory=dict)
    sentinel_kwargs: dict = field(default_factory=dict)


def is_sentinel_url(url: Any) -> bool:
    return isinstance(url, str) and url.split("://", 1)[0].lower() in SENTINEL_SCHEMES


def parse_sentinel_url(url: str) -> SentinelURL:
    """``redis+sentinel://[user:password@]host[:port][,host[:port]...]/<service>[?db=N&...]``
    (``rediss+sentinel://``: TLS to the data nodes). redis-py has no URL form for Sentinel,
    so kvgate reads this one; the user and password are the data nodes' (the gate's ACL user),
    ``sentinel_username`` / ``sentinel_password`` the sentinels'. Raises ValueError naming
    what is wrong, before any connection is made."""
    if not isinstance(url, str) or "://" not in url:
        raise ValueError(f"not a Sentinel URL: {url!r}")
    if any(ord(c) <= 32 or ord(c) == 127 for c in url):
        raise ValueError(f"Sentinel URL must not contain whitespace or control characters: {_redact(url)!r}")
    scheme, rest = url.split("://", 1)
    if scheme.lower() not in SENTINEL_SCHEMES:
        raise ValueError(f"Sentinel URL needs a redis+sentinel:// or rediss+sentinel:// scheme: {_redact(url)!r}")
    netloc, _, tail = rest.partition("/")
    path, _, query = tail.partition("?")
    if "#" in query or "#" in path:
        raise ValueError(f"Sentinel URL must not carry a fragment: {_redact(url)!r}")
    master: dict[str, Any] = {}
    creds, at, hosts = netloc.rpartition("@")
    if at:
        user, colon, password = creds.partition(":")
        if user:
            master["username"] = unquote(user)
        if colon:
            master["password"] = unquote(password)
    sentinels = []
    for h in hosts.split(","):
        if not h:
            raise ValueError(f"Sentinel URL has an empty sentinel address (hosts are host[:port], "
                             f"comma-separated): {_redact(url)!r}")
        parts = urlsplit("//" + h)
        try:
            port = parts.port
        except ValueError as e:
            raise ValueError(f"Sentinel URL has a bad port in {h!r} ({e}): {_redact(url)!r}") from e
        if not parts.hostname:
            raise ValueError(f"Sentinel URL has no host in {h!r}: {_redact(url)!r}")
        sentinels.append((parts.hostname, port or SENTINEL_PORT))
    service = unquote(path)
    if not service or "/" in service:
        raise ValueError(f"Sentinel URL needs the monitored service's name as its path "
                         f"(redis+sentinel://host:26379/mymaster): {_redact(url)!r}")
    sentinel_kw: dict[str, Any] = {}
    for k, v in parse_qsl(query, keep_blank_values=True, strict_parsing=False):
        if k not in _SENTINEL_QUERY:
            raise ValueError(f"Sentinel URL: unknown query key {k!r} (known: {', '.join(sorted(_SENTINEL_QUERY))}): "
                             f"{_redact(url)!r}")
        if k == "db":
            if not v.isdigit():
                raise ValueError(f"Sentinel URL: db must be a database number, got {v!r}")
            master["db"] = int(v)
        elif k.startswith("sentinel_"):
            sentinel_kw[k[len("sentinel_"):]] = v
        else:
            master[k] = v
    if SENTINEL_SCHEMES[scheme.lower()]:
        master["ssl"] = True
    elif any(k.startswith("ssl_") for k in master):
        raise ValueError(f"Sentinel URL: ssl_* keys need the rediss+sentinel:// scheme: {_redact(url)!r}")
    return SentinelURL(tuple(sentinels), service, master, sentinel_kw)


def _redact(url: str) -> str:
    """The URL without its password (errors land in logs)."""
    scheme, sep, rest = url.partition("://")
    netloc, slash, tail = rest.partition("/")
    creds, at, hosts = netloc.rpartition("@")
    if at and ":" in creds:
        creds = creds.split(":", 1)[0] + ":***"
    return f"{scheme}{sep}{creds}{at}{hosts}{slash}{tail}"
