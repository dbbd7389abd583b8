"""Private Redis servers: the bench's Redis, the tests' redis-servers and a Redis Cluster.

``embedded_redis()`` is a context manager yielding a ``redis://`` URL.  With the binary it
starts ``redis-server`` (no persistence, its own temp dir) and stops it by pid on exit.
Without it, it serves fakeredis (with Lua) over TCP on loopback with
``fakeredis.TcpFakeServer`` in a thread, so the gate connects by URL either way.

``start_redis()`` starts one ``redis-server`` child on a free loopback port (a
``RedisProc``, stopped by pid), and ``embedded_cluster()`` a Redis Cluster of them (masters,
no replicas, slots assigned by ``redis-cli --cluster create``). They are the one place that
starts servers: tests/conftest.py's fixtures and the benchmarks (benchmarks/scale.py
``--cluster``) both use them.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

import redis

__all__ = ["RESERVED_PORTS", "RedisProc", "embedded_cluster", "embedded_redis", "free_port", "start_redis"]

#: the port of a Redis this machine may run for something else: never started, never touched
RESERVED_PORTS = {6379}

#: how many ports start_redis tries before giving up (another process may take a free port
#: between the probe and redis-server's bind; redis-server then exits at once)
START_ATTEMPTS = 5


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


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


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


def _spawn(binary: str, port: int, extra: list[str], wait_s: float,
           config: str | None = None) -> tuple[RedisProc | None, str]:
    """Start one redis-server on ``port``: (the process, "") once it answers as itself, or
    (None, why) when it exited early (a taken port; its work dir is gone, its log quoted in
    ``why``). Not answering within ``wait_s`` while running raises: another port would not
    help. ``config``: the text of a config file, written into the server's own directory and
    passed first (where redis-server reads one; a sentinel also rewrites it, so each server
    gets its own copy)."""
    workdir = tempfile.mkdtemp(prefix="kvgate-redis-")
    conf = []
    if config is not None:
        conf = [os.path.join(workdir, "redis.conf")]
        with open(conf[0], "w") as f:
            f.write(config)
    args = [binary, *conf, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", workdir, "--logfile", os.path.join(workdir, "log"), *extra]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rp = RedisProc(port, proc, workdir, list(extra))
    deadline = time.monotonic() + wait_s
    while True:
        if proc.poll() is not None:
            why = f"exited with {proc.returncode}: {_log_tail(workdir)}"
            shutil.rmtree(workdir, ignore_errors=True)
            return None, why
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


def start_redis(port: int | None = None, *extra: str, wait_s: float = 10.0, attempts: int = START_ATTEMPTS,
                config: str | None = None) -> RedisProc:
    """A private redis-server (the binary on PATH). Without ``port`` a free one is picked,
    and a start that fails (the port was taken meanwhile) is retried on another port,
    ``attempts`` times. With a ``port`` (a restart on the same port) the same port is
    retried. ``{port}`` in an extra argument is replaced by the port tried (a cluster node's
    config file name). ``config``: a config file's text, passed as the first argument (a
    sentinel: ``config="sentinel monitor ..."`` with ``"--sentinel"`` in ``extra``)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise FileNotFoundError("redis-server not found on PATH")
    if port in RESERVED_PORTS:
        raise ValueError(f"port {port} is reserved for the machine's own Redis")
    cluster = "--cluster-enabled" in extra
    why = []
    for attempt in range(attempts):
        p = port if port is not None else free_port(cluster_bus=cluster)
        rp, err = _spawn(binary, p, [a.replace("{port}", str(p)) for a in extra], wait_s, config)
        if rp is not None:
            return rp
        why.append(f"port {p}: {err}")
        if port is not None:
            time.sleep(0.2 * (attempt + 1))  # the same port: give its last owner time to let go
    raise RuntimeError(f"redis-server did not start after {attempts} attempts: {'; '.join(why)}")


@contextlib.contextmanager
def embedded_cluster(masters: int = 3, wait_s: float = 20.0) -> Iterator[list[RedisProc]]:
    """A Redis Cluster of ``masters`` redis-servers (no replicas; slots assigned with
    ``redis-cli --cluster create``), yielded as its nodes once ``cluster_state:ok``; killed
    by pid on exit (SIGKILL: nothing of it is kept). Needs redis-server and redis-cli."""
    if shutil.which("redis-cli") is None:
        raise FileNotFoundError("redis-cli not found on PATH")
    nodes: list[RedisProc] = []
    try:
        for _ in range(masters):
            # start_redis picks ports whose bus port (port + 10000) is free too, and retries
            # on other ports when either was taken before redis-server bound it
            nodes.append(start_redis(None, "--cluster-enabled", "yes", "--cluster-config-file",
                                     "nodes-{port}.conf", "--cluster-node-timeout", "2000"))
        addrs = [f"127.0.0.1:{n.port}" for n in nodes]
        subprocess.run(["redis-cli", "--cluster", "create", *addrs, "--cluster-yes"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30)
        deadline = time.monotonic() + wait_s
        while True:
            c = nodes[0].client()
            try:
                info = c.execute_command("CLUSTER", "INFO")
            finally:
                c.close()
            if "cluster_state:ok" in (info.decode() if isinstance(info, bytes) else str(info)):
                break
            if time.monotonic() > deadline:
                raise RuntimeError("cluster did not become ok")
            time.sleep(0.2)
        yield nodes
    finally:
        for n in nodes:
            n.stop(signal.SIGKILL)
            shutil.rmtree(n.workdir, ignore_errors=True)


@contextlib.contextmanager
def _fake_server() -> Iterator[str]:
    from fakeredis import TcpFakeServer

    port = free_port()
    server = TcpFakeServer(("127.0.0.1", port), server_type="redis")
    t = threading.Thread(target=server.serve_forever, name="kvgate-bench-fakeredis", daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 10.0
        while not _ping(port):
            if time.monotonic() > deadline:
                raise RuntimeError("fakeredis TCP server did not start")
            time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        server.shutdown()
        server.server_close()
        t.join(timeout=5)


@contextlib.contextmanager
def embedded_redis(prefer: str = "auto") -> Iterator[tuple[str, str]]:
    """Yield ``(url, kind)`` with kind ``redis-server`` or ``fakeredis``.

    ``prefer``: ``auto`` (the binary when found), ``redis-server`` or ``fakeredis``.
    """
    if prefer not in ("auto", "redis-server", "fakeredis"):
        raise ValueError(f"embedded redis must be auto, redis-server or fakeredis, got {prefer!r}")
    binary = shutil.which("redis-server") if prefer != "fakeredis" else None
    if prefer == "redis-server" and binary is None:
        raise ValueError("redis-server binary not found on PATH")
    if binary is not None:
        rp = start_redis()
        try:
            yield rp.url, "redis-server"
        finally:
            rp.stop()
            shutil.rmtree(rp.workdir, ignore_errors=True)
    else:
        with _fake_server() as url:
            yield url, "fakeredis"
