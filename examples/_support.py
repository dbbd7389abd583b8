"""Helpers shared by the runnable examples (not part of kvgate): a private Redis and
line-atomic printing.  The examples import it from their own folder."""
from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import time
from typing import Any, Iterator


def say(line: str) -> None:
    """One write per line, so lines of threads and processes sharing stdout do not interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


@contextlib.contextmanager
def private_redis() -> Iterator[str]:
    """A private Redis for the example: a redis-server on a free loopback port (stopped by pid
    on exit) when the binary exists, else fakeredis served over TCP. Yields its URL. This is
    the embedded Redis of ``kvgate bench``."""
    from kvgate.tools.bench.redis_embed import embedded_redis

    with embedded_redis("auto") as (url, kind):
        say(f"started a private {kind} at {url}")
        yield url


def start_poller(stack: contextlib.ExitStack, gate: Any, **kw: Any) -> None:
    """Run a ``kvgate.control.poller.Poller`` over the sync ``gate`` in a thread (``kw``: its
    router or engines); ``stack`` stops it."""
    from kvgate.control.poller import Poller

    poller = Poller(gate, interval_s=0.5, leader_ttl_s=5.0, **kw)
    th = threading.Thread(target=poller.run, name="kvgate-poller", daemon=True)
    th.start()

    def stop_poller() -> None:
        poller.stop()
        th.join(10)
    stack.callback(stop_poller)


async def wait_fresh(gate: Any, wait_s: float) -> dict:
    """An async gate's status once a fresh snapshot is there, or after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        st = await gate.status()
        if not st["degraded"] or time.monotonic() > deadline:
            return st
        await asyncio.sleep(0.2)
