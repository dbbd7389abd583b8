"""Redis key layout of a gate.

Every key of a gate shares one Redis Cluster hash tag, ``{<gate>}``, so all of a gate's
state lives in one slot and every script can touch all of it atomically::

    kvgate:{qwen-32b-train}:ledger        HASH  reserved, epoch, seq
    kvgate:{qwen-32b-train}:snapshot      HASH  ts_ms, capacity, usage, n_healthy, engines, ...
    kvgate:{qwen-32b-train}:fifo          ZSET  ticket -> FIFO sequence
    ...

See docs/keys.md for every key with redis-cli examples.
"""
from __future__ import annotations

import re

PREFIX = "kvgate"

#: The keys every script receives, in KEYS order (lua/includes/common.lua names them).
SCRIPT_KEYS = (
    "ledger", "snapshot", "fifo", "waiters", "alive", "session_waiter", "leases",
    "lease_exp", "windows", "window_exp", "stats", "totals", "preempted", "window_order",
    "prefixes",
)

_GATE_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def validate_gate_name(gate: str) -> str:
    if not isinstance(gate, str) or not _GATE_RE.match(gate):
        raise ValueError(
            f"gate name must be 1-128 characters of letters, digits, '.', '_', ':' or '-'; got {gate!r}")
    return gate


def key(gate: str, name: str) -> str:
    """The Redis key ``kvgate:{gate}:name``."""
    return f"{PREFIX}:{{{gate}}}:{name}"


def script_keys(gate: str) -> list[str]:
    return [key(gate, n) for n in SCRIPT_KEYS]


def channel(gate: str) -> str:
    """Pub/sub channel on which scripts publish epoch bumps, and the grants and preemptions of
    waiters that name no channel of their own."""
    return key(gate, "events")


def listener_channel(gate: str, token: str) -> str:
    """The channel of one gate object's listener (``token`` names the object): the grants and
    preemptions of its waiters are published there, so they wake that one process, not every
    process subscribed to the gate's channel. Under the gate's channel name, so the same ACL
    pattern covers both."""
    return key(gate, f"events:{token}")
