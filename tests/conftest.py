"""Shared fixtures: real redis-server processes started by the tests, stopped by pid.

`redis_server` (session scope) starts one private `redis-server` on a free loopback
port; `redis_url` hands each test a clean database on it.  `redis_cluster` starts a
3-node Redis Cluster (no replicas) for the cluster-marked tests.

Where the binaries are missing the real-server tests skip, except under CI (the ``CI``
environment variable set, as CI services do) or with ``KVGATE_REQUIRE_REDIS=1``: there
they fail, so a CI image without redis-server cannot quietly drop that coverage.

Markers say what a test needs, so ``-m`` selects by them: every test that starts a
redis-server (through these fixtures, the ``backend`` fixture's "real" case, or
``start_redis``) carries ``redis_real``, and every test on ``redis_cluster`` carries
``cluster`` too. Collection stops on a test that uses those fixtures without its marker, and
``start_redis`` fails a test that reaches it unmarked, so ``-m "not redis_real"`` runs where
no redis-server binary exists.
"""
from __future__ import annotations

import os
import shutil
import signal

import pytest

from kvgate.tools.bench import redis_embed as _embed
# the servers are started in one place (redis_embed), shared with the benchmarks; the tests
# import these names from here
from kvgate.tools.bench.redis_embed import RESERVED_PORTS, RedisProc, free_port  # noqa: F401

REDIS_BIN = shutil.which("redis-server")

#: the fixtures that start a redis-server: a test that uses one is marked redis_real
REAL_REDIS_FIXTURES = frozenset({"redis_server", "redis_url", "fresh_redis", "redis_cluster"})

#: the test being set up or run (start_redis checks its markers)
_running: dict = {"item": None}


def pytest_collection_modifyitems(config, items):
    """Refuse a test whose markers do not say what it needs (see the module docstring)."""
    wrong = []
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        params = getattr(getattr(item, "callspec", None), "params", {})
        real = bool(names & REAL_REDIS_FIXTURES) or params.get("backend") == "real"
        if real and item.get_closest_marker("redis_real") is None:
            wrong.append(f"{item.nodeid}: starts a redis-server, not marked redis_real")
        if "redis_cluster" in names and item.get_closest_marker("cluster") is None:
            wrong.append(f"{item.nodeid}: starts a Redis Cluster, not marked cluster")
    if wrong:
        raise pytest.UsageError("tests whose markers do not say what they need:\n  " + "\n  ".join(wrong))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _running["item"] = item


def require_marker(name: str) -> None:
    """Fail the running test unless it carries marker ``name`` (what it is about to start)."""
    item = _running["item"]
    if item is not None and item.get_closest_marker(name) is None:
        pytest.fail(f"{item.nodeid} starts a {'Redis Cluster' if name == 'cluster' else 'redis-server'} "
                    f"but is not marked {name}", pytrace=False)


def redis_required() -> bool:
    """True when the real-server tests must run here (CI, or KVGATE_REQUIRE_REDIS=1)."""
    ci = os.environ.get("CI", "").strip().lower()
    return (ci not in ("", "0", "false", "no")) or os.environ.get("KVGATE_REQUIRE_REDIS", "").strip() == "1"


def require_binaries(*names: str) -> None:
    """Skip the calling test when a binary is missing, or fail it where redis_required()."""
    missing = [n for n in names if shutil.which(n) is None]
    if not missing:
        return
    msg = f"{', '.join(missing)} not found on PATH"
    if redis_required():
        pytest.fail(f"{msg}, and CI / KVGATE_REQUIRE_REDIS=1 says the real-server tests must run", pytrace=False)
    pytest.skip(msg)


def start_redis(port: int | None = None, *extra: str, **kw) -> RedisProc:
    """A private redis-server (kvgate.tools.bench.redis_embed.start_redis: its arguments),
    for a test marked redis_real; skipped, or failed where redis_required(), without the
    binary."""
    require_marker("redis_real")
    if REDIS_BIN is None:
        require_binaries("redis-server")
    return _embed.start_redis(port, *extra, **kw)


@pytest.fixture(scope="session")
def redis_server():
    rp = start_redis()
    yield rp
    rp.stop()


@pytest.fixture
def redis_url(redis_server):
    """A clean database on the session's private redis-server."""
    c = redis_server.client()
    c.flushall()
    c.script_flush()
    c.close()
    return redis_server.url


@pytest.fixture
def fresh_redis():
    """A private redis-server for this test alone (for restart / kill tests)."""
    rp = start_redis()
    yield rp
    rp.stop(signal.SIGKILL)


@pytest.fixture(scope="session")
def redis_cluster():
    """Three masters, no replicas, slots assigned with redis-cli --cluster create."""
    require_marker("cluster")
    require_binaries("redis-server", "redis-cli")
    require_marker("redis_real")
    with _embed.embedded_cluster() as nodes:
        yield nodes


# -- gate backends and drivers: one test body over several ------------------------------
@pytest.fixture(params=["fake", pytest.param("real", marks=pytest.mark.redis_real)])
def backend(request):
    """A factory of clients of one Redis: fakeredis (the fast layer), or the session's real
    redis-server (every script also runs there; the case is marked redis_real)."""
    from _gatehelpers import make_client
    if request.param == "real":
        url = request.getfixturevalue("redis_url")
        return lambda: make_client("real", url)
    import fakeredis
    server = make_client("fake", None).connection_pool.connection_kwargs["server"]
    return lambda: fakeredis.FakeRedis(server=server)


@pytest.fixture(params=["sync", "async"])
def driver(request):
    """The sync or the async gate's driver (tests/_gatehelpers.py: Driver): one test body
    for what both gates must do alike."""
    from _gatehelpers import Driver
    d = Driver(request.param)
    yield d
    d.stop()


@pytest.fixture
def clock():
    """An injected script clock (ms) that a test advances by hand."""
    from _gatehelpers import Clock
    return Clock()
