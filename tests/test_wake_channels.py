"""A grant or a preemption wakes the one gate object that waits for it: each gate object
listens on a channel of its own (kvgate.keys.listener_channel) besides the gate's, its waiters'
records name it (``ch``), and the scripts publish their grants and preemptions there. Waiter
records that name no channel (a script call without ``ch``, as an earlier kvgate sent) are
published on the gate's channel, which every listener still hears. On a real redis-server:
the messages themselves are checked."""
from __future__ import annotations

import threading
import time

import pytest
import redis

import kvgate
from kvgate import keys
from _gatehelpers import config, engines, script

pytestmark = pytest.mark.redis_real


def listen(url: str, *channels: str) -> redis.client.PubSub:
    ps = redis.Redis.from_url(url).pubsub(ignore_subscribe_messages=True)
    ps.subscribe(*channels)
    return ps


def messages(ps: redis.client.PubSub, bound_s: float = 1.0) -> list[tuple[str, str]]:
    out, end = [], time.monotonic() + bound_s
    while time.monotonic() < end:
        m = ps.get_message(timeout=0.05)
        if m is not None:
            out.append((m["channel"].decode(), m["data"].decode()))
    return out


def test_each_gate_object_has_its_own_channel_under_the_gates_name(redis_url):
    a = kvgate.Gate.from_url(redis_url, gate="w", config=config())
    b = kvgate.Gate.from_url(redis_url, gate="w", config=config())
    try:
        assert a.listen_channel != b.listen_channel
        for g in (a, b):
            assert g.listen_channel.startswith(keys.channel("w") + ":")
    finally:
        a.close()
        b.close()


def test_a_grant_and_a_preemption_go_to_the_waiters_own_channel(redis_url):
    gate = kvgate.Gate.from_url(redis_url, gate="w", config=config(headroom=1.0, residency=False))
    mine, other = keys.listener_channel("w", "mine"), keys.listener_channel("w", "other")
    ps = listen(redis_url, keys.channel("w"), mine, other)
    try:
        gate.write_snapshot(engines(cap=1000))
        held = gate.acquire("a", prompt_tokens=700, max_new_tokens=100)
        assert script(gate, "acquire", ticket="t1", session="b", need=600, probe=-2, ch=mine)["o"] == "wait"
        # a newer attempt of session b preempts t1: "p t1" on t1's channel
        assert script(gate, "acquire", ticket="t2", session="b", need=600, probe=-2, ch=other)["o"] == "wait"
        held.release()  # frees the place: t2, the head now, is granted on its own channel
        assert messages(ps) == [(mine, "p t1"), (other, "g t2")]
    finally:
        ps.close()
        gate.close()


def test_a_waiter_that_names_no_channel_is_woken_on_the_gates(redis_url):
    gate = kvgate.Gate.from_url(redis_url, gate="w", config=config(headroom=1.0, residency=False))
    ps = listen(redis_url, keys.channel("w"))
    try:
        gate.write_snapshot(engines(cap=1000))
        held = gate.acquire("a", prompt_tokens=700, max_new_tokens=100)
        assert script(gate, "acquire", ticket="t1", session="b", need=600, probe=-2)["o"] == "wait"
        held.release()
        assert messages(ps) == [(keys.channel("w"), "g t1")]
    finally:
        ps.close()
        gate.close()


def test_a_waiting_turn_is_woken_through_its_gates_own_channel(redis_url):
    gate = kvgate.Gate.from_url(redis_url, gate="w", config=config(headroom=1.0, residency=False))
    ps = listen(redis_url, keys.channel("w"), gate.listen_channel)
    try:
        gate.write_snapshot(engines(cap=1000))
        held = gate.acquire("a", prompt_tokens=700, max_new_tokens=100)

        got = {}
        t = threading.Thread(target=lambda: got.setdefault(
            "lease", gate.acquire("b", prompt_tokens=500, max_new_tokens=100)))
        t.start()
        deadline = time.monotonic() + 5
        while not gate.redis.zcard(gate.key("fifo")) and time.monotonic() < deadline:
            time.sleep(0.01)
        held.release()
        t.join(timeout=10)
        assert got["lease"].reason == "open"
        assert [c for c, d in messages(ps, 0.3) if d.startswith("g ")] == [gate.listen_channel]
        got["lease"].release()
    finally:
        ps.close()
        gate.close()
