"""Shared fixtures: real redis-server processes started by the tests, stopped by pid.

`redis_server` (session scope) starts one private `redis-server` on a free loopback
port; `redis_url` hands each test a clean database on it.  `redis_cluster` starts a
3-node Redis Cluster (no replicas) for the cluster-marked tests.
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def start_redis(port: int | None = None, *extra: str, wait_s: float = 10.0) -> RedisProc:
    if REDIS_BIN is None:
        pytest.skip("redis-server binary not found")
    port = port or free_port()
    workdir = tempfile.mkdtemp(prefix="kvgate-redis-")
    args = [REDIS_BIN, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", workdir, "--logfile", os.path.join(workdir, "log"), *extra]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rp = RedisProc(port, proc, workdir, list(extra))
    deadline = time.monotonic() + wait_s
    while True:
        try:
            if rp.client(socket_timeout=0.5).ping():
                return rp
        except redis.RedisError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            rp.stop(signal.SIGKILL)
            raise RuntimeError(f"redis-server on port {port} did not start")
        time.sleep(0.05)


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
    if REDIS_BIN is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server/redis-cli not found")
    nodes = []
    try:
        for _ in range(3):
            port = free_port()
            while port > 55535:  # the cluster bus listens on port + 10000
                port = free_port()
            nodes.append(start_redis(port, "--cluster-enabled", "yes", "--cluster-config-file",
                                     f"nodes-{port}.conf", "--cluster-node-timeout", "2000"))
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
