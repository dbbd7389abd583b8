"""A private Redis for the bench: ``redis-server`` on a free loopback port, else fakeredis.

``embedded_redis()`` is a context manager yielding a ``redis://`` URL.  With the binary it
starts ``redis-server`` (no persistence, its own temp dir) and stops it by pid on exit.
Without it, it serves fakeredis (with Lua) over TCP on loopback with
``fakeredis.TcpFakeServer`` in a thread, so the gate connects by URL either way.
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
from typing import Iterator

__all__ = ["embedded_redis", "free_port"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def _log_tail(workdir: str, lines: int = 3) -> str:
    try:
        with open(os.path.join(workdir, "redis.log"), errors="replace") as f:
            tail = [ln.strip() for ln in f.read().splitlines() if ln.strip()][-lines:]
    except OSError:
        tail = []
    return " | ".join(tail) if tail else "its log is empty"


@contextlib.contextmanager
def _redis_server(binary: str, wait_s: float = 10.0) -> Iterator[str]:
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="kvgate-bench-redis-")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", workdir, "--logfile", os.path.join(workdir, "redis.log")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + wait_s
        while not _ping(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                # the work dir goes on the way out: quote its log, not its path
                raise RuntimeError(f"redis-server did not start on port {port}: {_log_tail(workdir)}")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)


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
        with _redis_server(binary) as url:
            yield url, "redis-server"
    else:
        with _fake_server() as url:
            yield url, "fakeredis"
