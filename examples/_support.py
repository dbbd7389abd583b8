"""Helpers shared by the runnable examples (not part of kvgate): a private Redis and
line-atomic printing.  The examples import it from their own folder."""
from __future__ import annotations

import contextlib
import sys
from typing import Iterator


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
