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
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

import pytest
import redis

REDIS_BIN = shutil.which("redis-server")

#: the port of a Redis this machine may run for something else: never started, never touched
RESERVED_PORTS = {6379}

#: how many ports start_redis tries before giving up (another process may take a free port
#: between the probe and redis-server's bind; redis-server then exits at once)
START_ATTEMPTS = 5


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


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(cluster_bus: bool = False) -> int:
    """A loopback port free right now (not held: redis-server binds it itself, and
    start_redis retries on another one if it lost the race). With ``cluster_bus`` the port's
    cluster bus port (port + 10000) exists and is free too."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port in RESERVED_PORTS:
            continue
        if cluster_bus and (port + 10000 > 65535 or not _port_is_free(port + 10000)):
            continue
        return port


@dataclass
class RedisProc:
    """One redis-server child process; `stop()` kills it by pid."""

    port: int
    proc: subprocess.Popen
    workdir: str
    extra: list = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def client(self, **kw) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, **kw)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


def _log_tail(workdir: str, n: int = 5) -> str:
    try:
        with open(os.path.join(workdir, "log"), errors="replace") as f:
            lines = [ln.strip() for ln in f.read().splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    return " | ".join(lines[-n:]) or "(empty log)"


def _spawn(port: int, extra: list[str], wait_s: float, config: str | None = None) -> tuple[RedisProc | None, str]:
    """Start one redis-server on ``port``: (the process, "") once it answers as itself, or
    (None, why) when it exited early (a taken port). Not answering within ``wait_s`` while
    running raises: another port would not help. ``config``: the text of a config file,
    written into the server's own directory and passed first (where redis-server reads one;
    a sentinel also rewrites it, so each server gets its own copy)."""
    workdir = tempfile.mkdtemp(prefix="kvgate-redis-")
    conf = []
    if config is not None:
        conf = [os.path.join(workdir, "redis.conf")]
        with open(conf[0], "w") as f:
            f.write(config)
    args = [REDIS_BIN, *conf, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", workdir, "--logfile", os.path.join(workdir, "log"), *extra]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rp = RedisProc(port, proc, workdir, list(extra))
    deadline = time.monotonic() + wait_s
    while True:
        if proc.poll() is not None:
            return None, f"exited with {proc.returncode}: {_log_tail(workdir)}"
        try:
            c = rp.client(socket_timeout=0.5)
            try:
                # the server answering must be ours: another process may hold the port we lost
                if int(c.info("server")["process_id"]) == proc.pid:
                    return rp, ""
            finally:
                c.close()
        except redis.RedisError:
            pass
        if time.monotonic() > deadline:
            rp.stop(signal.SIGKILL)
            raise RuntimeError(f"redis-server on port {port} did not answer within {wait_s}s: {_log_tail(workdir)}")
        time.sleep(0.05)


def start_redis(port: int | None = None, *extra: str, wait_s: float = 10.0,
                attempts: int = START_ATTEMPTS, config: str | None = None) -> RedisProc:
    """A private redis-server. Without ``port`` a free one is picked, and a start that fails
    (the port was taken meanwhile) is retried on another port, ``attempts`` times. With a
    ``port`` (a restart on the same port) the same port is retried. ``{port}`` in an extra
    argument is replaced by the port tried (a cluster node's config file name). ``config``:
    a config file's text, passed as the first argument (a sentinel: ``config="sentinel
    monitor ..."`` with ``"--sentinel"`` in ``extra``)."""
    require_marker("redis_real")
    if REDIS_BIN is None:
        require_binaries("redis-server")
    if port in RESERVED_PORTS:
        raise ValueError(f"port {port} is reserved for the machine's own Redis")
    cluster = "--cluster-enabled" in extra
    why = []
    for attempt in range(attempts):
        p = port if port is not None else free_port(cluster_bus=cluster)
        rp, err = _spawn(p, [a.replace("{port}", str(p)) for a in extra], wait_s, config)
        if rp is not None:
            return rp
        why.append(f"port {p}: {err}")
        if port is not None:
            time.sleep(0.2 * (attempt + 1))  # the same port: give its last owner time to let go
    raise RuntimeError(f"redis-server did not start after {attempts} attempts: {'; '.join(why)}")


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
    nodes = []
    try:
        for _ in range(3):
            # start_redis picks ports whose bus port (port + 10000) is free too, and retries
            # on other ports when either was taken before redis-server bound it
            nodes.append(start_redis(None, "--cluster-enabled", "yes", "--cluster-config-file",
                                     "nodes-{port}.conf", "--cluster-node-timeout", "2000"))
        addrs = [f"127.0.0.1:{n.port}" for n in nodes]
        subprocess.run(["redis-cli", "--cluster", "create", *addrs, "--cluster-yes"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            info = nodes[0].client().execute_command("CLUSTER", "INFO")
            if isinstance(info, bytes):
                info = info.decode()
            if "cluster_state:ok" in str(info):
                break
            time.sleep(0.2)
        else:
            raise RuntimeError("cluster did not become ok")
        yield nodes
    finally:
        for n in nodes:
            n.stop(signal.SIGKILL)


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
