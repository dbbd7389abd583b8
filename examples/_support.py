"""Helpers shared by the runnable examples (not part of kvgate): a private redis-server and
line-atomic printing.  The examples import it from their own folder."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Iterator


def say(line: str) -> None:
    """One write per line, so lines of threads and processes sharing stdout do not interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def private_redis(wait_s: float = 10.0) -> Iterator[str]:
    """A redis-server on a free loopback port, without persistence; stopped by pid on exit.
    Yields its URL.  Exits with a message when the binary is missing."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server not found: install it or pass --redis URL")
    import redis

    port = free_port()
    workdir = tempfile.mkdtemp(prefix="kvgate-example-redis-")
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", workdir],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                if redis.Redis(host="127.0.0.1", port=port, socket_timeout=0.5).ping():
                    break
            except redis.RedisError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"redis-server did not start on port {port}")
            time.sleep(0.05)
        say(f"started private redis-server pid={proc.pid} at {url}")
        yield url
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)
