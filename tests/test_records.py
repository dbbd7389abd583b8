"""docs/keys.md#records is the one place the stored records' short field names are described:
a run through every state of a waiter, a lease, a window and a shared prefix writes exactly
the fields it lists, no more and no fewer."""
from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import kvgate

from _gatehelpers import Clock, engines, script

KEYS_MD = Path(__file__).resolve().parent.parent / "docs" / "keys.md"


def documented() -> dict[str, set[str]]:
    """Record -> the fields its table in docs/keys.md names."""
    out: dict[str, set[str]] = {}
    text = KEYS_MD.read_text(encoding="utf-8")
    records = text[text.index("\n## Records\n"):]
    for m in re.finditer(r"^### (\w+)\n(.*?)(?=^#|\Z)", records, re.M | re.S):
        out[m.group(1).lower()] = set(re.findall(r"^\| `(\w+)` \|", m.group(2), re.M))
    return out


def test_the_records_have_exactly_the_documented_fields(backend):
    clock = Clock()
    g = kvgate.Gate(backend(), gate="rec", config=kvgate.GateConfig(wait_poll_s=0.2, headroom=1.0), clock_ms=clock)
    seen: dict[str, set[str]] = defaultdict(set)

    def look():
        for record, key in (("waiter", "waiters"), ("lease", "leases"), ("window", "windows"),
                            ("prefix", "prefixes")):
            for raw in g.redis.hvals(g.key(key)):
                seen[record] |= set(json.loads(raw))
        for e in json.loads(g.redis.hget(g.key("snapshot"), "engines") or "[]"):
            seen["engine"] |= set(e)

    def call(name, **params):
        out = script(g, name, **params)
        look()
        return out

    g.write_snapshot(engines(usage=0.1, cap=1000))
    # a lease under a window it opened; then an engine-set change marks the held window revoked
    assert call("acquire", ticket="A", session="a", need=100, probe=-2, retain=1)["o"] == "admit"
    g.bump_epoch()
    assert call("acquire", ticket="A2", session="a", need=10, probe=-2)["o"] == "admit"
    call("release", ticket="A2")
    # a FIFO grant not yet claimed: B waits for C's room, C's release grants it
    assert call("acquire", ticket="C", session="c", need=800, probe=-2)["o"] == "admit"
    assert call("acquire", ticket="B", session="b", need=500, probe=-2)["o"] == "wait"
    call("release", ticket="C")
    assert json.loads(g.redis.hget(g.key("leases"), "B"))["c"] == 1
    # an idle window in its grace
    call("release", ticket="A")
    call("acquire", ticket="I", session="i", need=10, probe=-2, retain=1)
    call("release", ticket="I")
    assert json.loads(g.redis.hget(g.key("windows"), "i"))["x"] > 0
    call("release", ticket="B")
    # a waiter that began before it enqueued (b), preempted by a newer attempt that is away
    # probing, so it still holds the FIFO place it passes on (q)
    g.write_snapshot(engines(usage=0.88, cap=1000))  # between the watermark and the guard
    assert call("acquire", ticket="W1", session="w", need=10, probe=0.0, t0=clock() - 5,
                ch=g._flows.listen_channel)["o"] == "wait"
    clock.advance(0.01)
    assert call("acquire", ticket="W2", session="w", need=10, probe=-1)["o"] == "probe"
    assert json.loads(g.redis.hget(g.key("waiters"), "W1")).keys() >= {"q", "b", "st"}
    # a shared prefix held by a window and by a lease of its own, and a waiter that shares it
    shared = dict(prefixes=[["task", 60]])
    g.write_snapshot(engines(usage=0.1, cap=1000))
    assert call("acquire", ticket="P1", session="p1", need=100, probe=-2, retain=1, **shared)["o"] == "admit"
    assert call("acquire", ticket="P2", session="p2", need=100, probe=-2, **shared)["o"] == "admit"
    assert call("acquire", ticket="P3", session="p3", need=990, probe=-2, **shared)["o"] == "wait"
    assert json.loads(g.redis.hget(g.key("prefixes"), "task")) == {"t": 60, "h": 2}
    assert dict(seen) == documented()
