"""The sync gate, where a review found it broke its guarantees: close() under another thread's
call, a client passed in closed by the gate, probes that raise BaseException, plain Redis
commands past an open breaker, and a gate used in a child of os.fork()."""
from __future__ import annotations

import asyncio
import os
import sys
import threading

import fakeredis
import pytest
import redis

import kvgate

from _gatehelpers import engines


def cfg(**kw) -> kvgate.GateConfig:
    return kvgate.GateConfig(**{"wait_poll_s": 0.2, "max_wait_s": 30.0, **kw})


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
        g = kvgate.Gate.from_url(redis_url, gate="cl", config=cfg(redis_timeout_s=1.0))
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
        a = kvgate.Gate(shared, gate="sa", config=cfg())
        b = kvgate.Gate(shared, gate="sb", config=cfg())
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


@pytest.mark.parametrize("exc", [SystemExit(3), GeneratorExit(), asyncio.CancelledError(), KeyboardInterrupt()])
def test_a_probe_raising_a_base_exception_is_a_failed_probe(exc):
    # raised in the probe's thread, so never an interrupt of the caller: fail open (rule 8)
    class Raising:
        def probe(self, session_id, prompt_ids):
            raise exc

    g = kvgate.Gate(fakeredis.FakeRedis(), gate="bx", probe=Raising(), config=cfg(admission=False))
    g.write_snapshot(engines(usage=0.9))
    lease = g.acquire("s", prompt_ids=[1, 2, 3], max_new_tokens=4)
    assert (lease.outcome, lease.reason) == ("admit", "prefix_probe_unavailable")
    lease.release()
    g.close()


def test_plain_commands_respect_the_breaker():
    g = kvgate.Gate(fakeredis.FakeRedis(), gate="br", config=cfg(session_lifecycle=True))
    calls = []
    real_hget = g.redis.hget

    def failing_hget(*a, **kw):
        calls.append(a)
        raise redis.ConnectionError("Redis went away")
    g.redis.hget = failing_hget
    assert g.num_preempted("s") == 0
    assert g._flows.breaker_open()  # the fault tripped the breaker
    n = len(calls)
    assert g.num_preempted("s") == 0
    assert len(calls) == n  # skipped while the breaker is open: no more time on a dead Redis
    # the close targets are read past the breaker (a session's close must reach its engines)
    assert g.engine_urls() == [] and len(calls) == n + 1
    g.redis.hget = real_hget
    g.close()


@pytest.mark.skipif(not hasattr(os, "fork") or sys.platform == "darwin", reason="needs os.fork")
def test_a_child_of_fork_gets_its_own_probe_threads():
    # the child inherited a pool that believed it had an idle thread: its first probes queued
    # behind a thread that does not exist, and timed out
    class Quick:
        def probe(self, session_id, prompt_ids):
            return kvgate.ProbeResult(1.0)

    g = kvgate.Gate(fakeredis.FakeRedis(), gate="fk", probe=Quick(), config=cfg(admission=False, probe_timeout_s=2.0))
    g.write_snapshot(engines(usage=0.9))
    g.acquire("p", prompt_ids=[1, 2, 3], max_new_tokens=4).release()  # the parent's pool exists
    pid = os.fork()
    if pid == 0:  # the child: report by exit code only
        code = 1
        try:
            lease = g.acquire("c", prompt_ids=[1, 2, 3], max_new_tokens=4)
            code = 0 if lease.reason == "resident_prefix" else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    g.close()


def test_a_close_is_sent_while_the_breaker_is_open():
    # the engine list is read past the breaker: one failed call a moment ago must not send a
    # session's /close_session to no engine (and count nothing)
    g = kvgate.Gate(fakeredis.FakeRedis(), gate="cb", config=cfg(session_lifecycle=True, close_timeout_s=2.0))
    g.write_snapshot([kvgate.EngineState("http://127.0.0.1:9", capacity_tokens=1000, usage=0.1, healthy=True,
                                         url="http://127.0.0.1:9")])  # nothing listens there
    g._flows.trip()
    out = g.finish_session("s")
    assert out["close"] == {"attempts": 1, "failures": 1}


def test_an_engine_list_that_cannot_be_read_is_a_counted_failure():
    g = kvgate.Gate(fakeredis.FakeRedis(), gate="cf", config=cfg(session_lifecycle=True, close_timeout_s=2.0))

    def down(*a, **kw):
        raise redis.ConnectionError("Redis went away")
    g.redis.hget = down
    out = g.finish_session("s")
    assert out["close"]["failures"] == 1 and out["close"]["attempts"] == 1


def test_the_async_close_is_sent_while_the_breaker_is_open():
    async def main():
        g = kvgate.AsyncGate(fakeredis.FakeAsyncRedis(), gate="acb",
                             config=cfg(session_lifecycle=True, close_timeout_s=2.0))
        await g.write_snapshot([kvgate.EngineState("http://127.0.0.1:9", capacity_tokens=1000, usage=0.1,
                                                   healthy=True, url="http://127.0.0.1:9")])
        g._flows.trip()
        out = await g.finish_session("s")
        await g.aclose()
        return out
    assert asyncio.run(main())["close"] == {"attempts": 1, "failures": 1}
