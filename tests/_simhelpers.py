"""Helpers for the simulator tests: a small engine's knobs, reproducible token ids, and an
HTTP client that talks to loopback servers directly (no proxy, no Nagle delay)."""
from __future__ import annotations

import random
import socket

import httpx

#: the block size of the small engines below
B = 16
SMALL = dict(kv_capacity_tokens=2048, block_size=B, context_length=None, max_running_requests=16)


def rand_ids(seed: int, n: int) -> list:
    r = random.Random(seed)
    return [r.randrange(1000, 100000) for _ in range(n)]


def client(timeout: float = 20.0) -> httpx.Client:
    tr = httpx.HTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
    return httpx.Client(trust_env=False, timeout=timeout, transport=tr)
