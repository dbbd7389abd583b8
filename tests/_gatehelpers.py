"""Helpers for the gate tests: backends (fakeredis / real redis-server), a manual clock."""
from __future__ import annotations

import fakeredis
import redis

import kvgate


class Clock:
    """An injected script clock in ms that tests advance by hand."""

    def __init__(self, start_ms: int = 1_700_000_000_000):
        self.ms = start_ms

    def __call__(self) -> int:
        return self.ms

    def advance(self, seconds: float) -> None:
        self.ms += int(seconds * 1000)


def engines(usage: float = 0.1, cap: int = 10_000, n: int = 1, healthy: bool = True):
    return [kvgate.EngineState(f"http://127.0.0.1:{9000 + i}", capacity_tokens=cap, usage=usage,
                               healthy=healthy, url=f"http://127.0.0.1:{9000 + i}") for i in range(n)]


def make_client(backend: str, url: str | None):
    if backend == "fake":
        return fakeredis.FakeRedis(server=fakeredis.FakeServer())
    return redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)


def script(gate: kvgate.Gate, name: str, **params) -> dict:
    """Call one script directly (one atomic transition), with the gate's knobs. The client
    always sends an acquire's ``prompt``, ``protected`` and ``retain`` (the script requires
    them); a test that leaves them out means a turn whose whole need is its prompt, not
    protected, that opens no window."""
    if name == "acquire":
        if "need" in params:
            params.setdefault("prompt", params["need"])
        params.setdefault("protected", 0)
        params.setdefault("retain", 0)
    return gate._eval(gate._flows.eval_op(name, params))
