"""Closing a gate, on a real redis-server: close() and aclose() wait for a give-back still
in flight in another thread or task (a slow release is not lost to a closed client), a
client passed in is never closed under another gate that shares it, and an async gate
outlives the event loop it was first used from (its pooled connections are that loop's)."""
from __future__ import annotations

import asyncio
import threading

import pytest
import redis
import redis.asyncio as aioredis

import kvgate

from _gatehelpers import config, engines

pytestmark = pytest.mark.redis_real


def _release_in_thread(lease):
    out: dict = {}

    def run():
        try:
            out["released"] = lease.release()
        except BaseException as e:  # noqa: BLE001 - the test reports it
            out["error"] = repr(e)
    t = threading.Thread(target=run)
    t.start()
    return t, out


def test_close_waits_for_another_threads_release(redis_url):
    admin = redis.Redis.from_url(redis_url)
    try:
        g = kvgate.Gate.from_url(redis_url, gate="cl", config=config(redis_timeout_s=1.0))
        g.write_snapshot(engines(usage=0.1))
        lease = g.acquire("s", prompt_tokens=100, max_new_tokens=10)
        assert lease.outcome == "admit"
        admin.execute_command("CLIENT", "PAUSE", "500", "ALL")  # the release is slow
        t, out = _release_in_thread(lease)
        threading.Event().wait(0.1)  # the release is on the wire (a paused Redis holds it)
        g.close()
        t.join(30)
        assert not t.is_alive() and "error" not in out, out
        assert admin.hlen(g.key("leases")) == 0
    finally:
        admin.close()


def test_a_client_passed_in_is_not_closed_under_another_gate(redis_url):
    admin = redis.Redis.from_url(redis_url)
    shared = redis.Redis.from_url(redis_url, socket_timeout=5)
    try:
        a = kvgate.Gate(shared, gate="sa", config=config())
        b = kvgate.Gate(shared, gate="sb", config=config())
        b.write_snapshot(engines(usage=0.1))
        lease = b.acquire("s", prompt_tokens=100, max_new_tokens=10)
        admin.execute_command("CLIENT", "PAUSE", "500", "ALL")
        t, out = _release_in_thread(lease)
        threading.Event().wait(0.1)
        a.close()  # gate a is done; b goes on with the same client
        t.join(30)
        assert "error" not in out and out["released"] is True, out
        assert admin.hlen(b.key("leases")) == 0
        assert shared.ping()
        b.close()
    finally:
        shared.close()
        admin.close()


def test_aclose_waits_for_a_release_still_in_flight(redis_url):
    # a caller cancelled while its shielded release runs moves on; aclose() closed the client
    # under that release, which was then deferred into a closed gate: the lease stayed charged
    # until lease_ttl_s
    admin = redis.Redis.from_url(redis_url)

    async def main():
        g = kvgate.AsyncGate.from_url(redis_url, gate="ac", config=config(redis_timeout_s=1.0))
        await g.write_snapshot(engines(usage=0.1))
        lease = await g.acquire("s", prompt_tokens=100, max_new_tokens=10)
        assert lease.outcome == "admit"
        assert int(admin.hlen(g.key("leases"))) == 1
        admin.execute_command("CLIENT", "PAUSE", "500", "ALL")  # the release is slow
        t = asyncio.ensure_future(lease.release())
        for _ in range(5):
            await asyncio.sleep(0)
        t.cancel()  # the caller gives up; the shielded release runs on
        await g.aclose()

    try:
        asyncio.run(main())
        # the lease is gone and the window it held is idle (its grace runs; it stays charged)
        assert admin.hlen("kvgate:{ac}:leases") == 0
        assert b'"h":0' in admin.hget("kvgate:{ac}:windows", "s")
    finally:
        admin.close()


def test_a_gate_used_from_a_second_event_loop_still_decides(redis_url):
    # two asyncio.run calls, or a gate at module scope under per-test loops: the first loop's
    # pooled connections raised RuntimeError ("Event loop is closed") into acquire
    g = kvgate.AsyncGate(aioredis.Redis.from_url(redis_url, socket_timeout=2), gate="tl", config=config())

    async def turn(sid):
        await g.write_snapshot(engines(usage=0.1))
        lease = await g.acquire(sid, prompt_tokens=100, max_new_tokens=10)
        await lease.release()
        return lease.outcome, lease.reason

    assert asyncio.run(turn("a")) == ("admit", "open")
    assert asyncio.run(turn("b")) == ("admit", "open")

    async def close():
        await g.aclose()
    asyncio.run(close())
