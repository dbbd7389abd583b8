"""The client when Redis cannot answer: a fault opens the breaker and turns degrade at once;
a release or cancel that missed Redis (never sent, or its reply lost) is deferred and sent
once Redis answers, at the next call or at close, never twice and never unbounded; every
call is bounded by redis_timeout_s (a stalled Redis, a cluster that cannot be reached, a
client without a bound of its own is warned about); a waiter whose pub/sub cannot start
polls instead of spinning.

Each test names the way the ledger would go wrong without the behaviour it checks."""
from __future__ import annotations

import asyncio
import time
import warnings

import fakeredis
import fakeredis.aioredis
import pytest
import redis
import redis.asyncio as aioredis

import kvgate

from _gatehelpers import FAST, TURN, config, engines, ledger

#: a Redis stall (CLIENT PAUSE ... ALL; CLIENT UNPAUSE waits behind it too, so it just ends)
PAUSE_MS = 9000


class FlakyRedis(fakeredis.FakeRedis):
    """A fakeredis whose next script calls fail: ``fail_before`` raises without running the
    script (Redis never saw it), ``fail_after`` runs it and then raises (the reply was lost,
    as when a stalled Redis answers after the client's timeout)."""

    fail_before = 0
    fail_after = 0
    before_exc: type = redis.ConnectionError  # what a fail_before raises

    def _flaky(self, call, *args, **kw):
        if self.fail_before:
            self.fail_before -= 1
            raise self.before_exc("injected: not sent")
        r = call(*args, **kw)
        if self.fail_after:
            self.fail_after -= 1
            raise redis.TimeoutError("injected: reply lost")
        return r

    # a script call is an FCALL (the function library), or an EVALSHA where functions are not run
    def fcall(self, *args, **kw):
        return self._flaky(super().fcall, *args, **kw)

    def evalsha(self, *args, **kw):
        return self._flaky(super().evalsha, *args, **kw)


class AsyncFlakyRedis(fakeredis.aioredis.FakeRedis):
    fail_before = 0
    fail_after = 0
    before_exc: type = redis.ConnectionError

    async def _flaky(self, call, *args, **kw):
        if self.fail_before:
            self.fail_before -= 1
            raise self.before_exc("injected: not sent")
        r = await call(*args, **kw)
        if self.fail_after:
            self.fail_after -= 1
            raise redis.TimeoutError("injected: reply lost")
        return r

    async def fcall(self, *args, **kw):
        return await self._flaky(super().fcall, *args, **kw)

    async def evalsha(self, *args, **kw):
        return await self._flaky(super().evalsha, *args, **kw)


def close_breaker(gate) -> None:
    gate._flows._breaker_until = 0.0  # as if BREAKER_S had passed


#: plain leases (no ownership window), so a release gives the tokens straight back
PLAIN = dict(retain_session=False)


def sync_gate(clock, **cfg):
    return kvgate.Gate(FlakyRedis(server=fakeredis.FakeServer()), gate="g",
                       config=kvgate.GateConfig(**{**FAST, **cfg}), clock_ms=clock)


# -- the breaker: releases and cancels that miss Redis are sent once it answers -----------
def test_release_while_breaker_open_is_sent_later(clock):
    g = sync_gate(clock)
    g.write_snapshot(engines())
    lease = g.acquire("s", prompt_tokens=100, max_new_tokens=10, **PLAIN)
    assert lease.held and ledger(g) == 110
    g._flows.trip()  # a fault elsewhere in this process
    assert lease.release() is False
    assert g.deferred_count == 1 and ledger(g) == 110
    close_breaker(g)
    # the next call of any kind sends the release first
    other = g.acquire("t", prompt_tokens=5, max_new_tokens=5, **PLAIN)
    assert g.deferred_count == 0
    assert ledger(g) == 10  # only t's lease: s gave its back, nothing waits for the TTL
    other.release()
    assert ledger(g) == 0
    assert g.step_metrics()["agentic_kv/client/deferred"] == 1


def test_release_whose_reply_was_lost_is_sent_again(clock):
    g = sync_gate(clock)
    g.write_snapshot(engines())
    lease = g.acquire("s", prompt_tokens=100, max_new_tokens=10, **PLAIN)
    g.redis.fail_before = 1  # the release never reaches Redis
    assert lease.release() is False and ledger(g) == 110
    close_breaker(g)
    g.step_metrics()  # any script call flushes
    assert ledger(g) == 0 and g.deferred_count == 0


def test_deferred_release_under_a_window_is_not_charged_twice(clock):
    # without the deferral the window stays held until lease_ttl_s, and every later turn
    # of the session is charged again as a branch on top of it
    g = sync_gate(clock)
    g.write_snapshot(engines())
    lease = g.acquire("s", prompt_tokens=100, max_new_tokens=10)  # retained: it opens a window
    assert lease.reason == "open" and g.redis.hexists(g.key("windows"), "s")
    g._flows.trip()
    lease.release()
    close_breaker(g)
    nxt = g.acquire("s", prompt_tokens=120, max_new_tokens=10)
    assert nxt.reason == "reserved_session"
    assert ledger(g) == 130  # the window, grown to the turn: one charge
    nxt.release()
    assert ledger(g) == 130  # the window idles, still charged once
    assert g.finish_session("s")["freed"] == 130 and ledger(g) == 0


def test_acquire_that_ran_but_timed_out_gives_its_lease_back(clock):
    g = sync_gate(clock)
    g.write_snapshot(engines())
    g.redis.fail_after = 1  # the script admits, the reply is lost
    lease = g.acquire("s", prompt_tokens=100, max_new_tokens=10, **PLAIN)
    assert (lease.outcome, lease.reason, lease.held) == ("bypass", "degraded", False)
    assert ledger(g) == 110 and g.deferred_count == 1  # Redis holds a lease nobody will release
    close_breaker(g)
    g.step_metrics()
    assert ledger(g) == 0 and g.redis.hlen(g.key("leases")) == 0


def three_released_while_down(clock):
    """A gate whose three leases (10 tokens each) were released with the breaker open."""
    g = sync_gate(clock)
    g.write_snapshot(engines())
    leases = [g.acquire(f"s{i}", prompt_tokens=10, max_new_tokens=0, **PLAIN) for i in range(3)]
    g._flows.trip()
    for lease in leases:
        lease.release()
    return g


def test_acquire_refused_by_the_breaker_defers_nothing(clock):
    g = sync_gate(clock)
    g.write_snapshot(engines())
    g._flows.trip()
    lease = g.acquire("s", prompt_tokens=100, max_new_tokens=10, **PLAIN)
    assert lease.reason == "degraded" and g.deferred_count == 0  # never sent: nothing to give back


def test_failed_flush_keeps_the_rest_and_sends_nothing_else(clock):
    g = three_released_while_down(clock)
    assert g.deferred_count == 3
    close_breaker(g)
    g.redis.fail_before = 1  # the first deferred release fails again
    assert g.acquire("t", prompt_tokens=1, max_new_tokens=0, **PLAIN).reason == "degraded"
    assert g.deferred_count == 3 and ledger(g) == 30  # t was not sent either
    close_breaker(g)
    g.step_metrics()
    assert g.deferred_count == 0 and ledger(g) == 0


def test_deferred_operations_are_bounded(clock, monkeypatch):
    import kvgate.client.flows as flows
    monkeypatch.setattr(flows, "MAX_DEFERRED", 2)
    g = three_released_while_down(clock)
    assert g.deferred_count == 2  # the oldest is left to lease_ttl_s
    m = g.step_metrics()  # breaker open: counted locally
    assert m["agentic_kv/client/deferred"] == 3 and m["agentic_kv/client/deferred_dropped"] == 1


def test_async_release_and_lost_acquire_are_sent_later(clock):
    async def main():
        g = kvgate.AsyncGate(AsyncFlakyRedis(server=fakeredis.FakeServer()), gate="g",
                             config=kvgate.GateConfig(**FAST), clock_ms=clock)
        await g.write_snapshot(engines())
        lease = await g.acquire("s", prompt_tokens=100, max_new_tokens=10, **PLAIN)
        g._flows.trip()
        assert await lease.release() is False
        close_breaker(g)
        await g.step_metrics()  # sends s's release
        assert int(await g.redis.hget(g.key("ledger"), "reserved")) == 0 and g.deferred_count == 0
        g.redis.fail_after = 1
        lost = await g.acquire("t", prompt_tokens=50, max_new_tokens=0, **PLAIN)  # it runs, the reply is lost
        assert lost.reason == "degraded"
        assert int(await g.redis.hget(g.key("ledger"), "reserved")) == 50
        assert g.deferred_count == 1
        close_breaker(g)
        await g.step_metrics()
        assert int(await g.redis.hget(g.key("ledger"), "reserved") or 0) == 0
        assert g.deferred_count == 0
        await g.aclose()
    asyncio.run(main())


def test_async_cancel_while_breaker_open_is_sent_later():
    async def main():
        g = kvgate.AsyncGate(AsyncFlakyRedis(server=fakeredis.FakeServer()), gate="g",
                             config=kvgate.GateConfig(max_wait_s=30.0, wait_poll_s=5.0))
        await g.write_snapshot(engines(usage=0.99))  # above the guard: the turn waits
        task = asyncio.ensure_future(g.acquire("s", prompt_tokens=10, max_new_tokens=0, **PLAIN))
        for _ in range(200):
            if await g.redis.zcard(g.key("fifo")):
                break
            await asyncio.sleep(0.01)
        g._flows.trip()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await g.redis.zcard(g.key("fifo")) == 1 and g.deferred_count == 1
        close_breaker(g)
        await g.step_metrics()
        assert await g.redis.zcard(g.key("fifo")) == 0 and await g.redis.hlen(g.key("waiters")) == 0
        await g.aclose()
    asyncio.run(main())


def test_redis_down_degrades_and_the_release_is_sent_later(driver):
    g = driver.gate()
    driver(g.write_snapshot(engines()))
    lease = driver(g.acquire("s", retain_session=False, **TURN))
    g._flows.trip()  # a fault elsewhere in this process
    assert driver(g.acquire("t", **TURN)).reason == "degraded"
    assert driver(lease.release()) is False and g.deferred_count == 1
    g._flows._breaker_until = float("-inf")
    driver(g.step_metrics())
    assert g.deferred_count == 0 and int(driver(g.redis.hlen(g.key("leases")))) == 0
    driver.close(g)


def test_plain_commands_respect_the_breaker():
    g = kvgate.Gate(fakeredis.FakeRedis(), gate="br", config=config(session_lifecycle=True))
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


# -- every call is bounded -----------------------------------------------------------------
@pytest.mark.redis_real
def test_finish_session_is_bounded_when_redis_stalls(redis_url):
    # engine_urls() and record_close() used the client directly, with no deadline and past an
    # open breaker: a stalled Redis held finish_session for as long as the stall
    admin = redis.Redis.from_url(redis_url)

    async def main():
        client = aioredis.Redis.from_url(redis_url, socket_timeout=60)  # a long timeout of its own
        g = kvgate.AsyncGate(client, gate="fs", config=config(session_lifecycle=True, redis_timeout_s=0.5))
        await g.write_snapshot(engines(usage=0.1))
        admin.execute_command("CLIENT", "PAUSE", str(PAUSE_MS), "ALL")
        t0 = time.monotonic()
        out = await asyncio.wait_for(g.finish_session("s"), 60)
        took = time.monotonic() - t0
        # the script call's deadline and the engine list's (1.5 s each; the counters skip Redis
        # past the open breaker); before, the rest of the stall (a bound that guards a hang,
        # with a wide margin, not a timing claim)
        assert took < PAUSE_MS / 1000 - 3, took
        # the engine list could not be read: a close that reached no engine, counted as failed
        assert "error" in out and out["close"] == {"attempts": 1, "failures": 1}
        await asyncio.sleep(PAUSE_MS / 1000 - took + 0.5)  # the pause is over
        await g.aclose()

    try:
        asyncio.run(main())
    finally:
        admin.close()


@pytest.mark.redis_real
def test_num_preempted_is_bounded_when_redis_stalls(redis_url):
    admin = redis.Redis.from_url(redis_url)

    async def main():
        g = kvgate.AsyncGate(aioredis.Redis.from_url(redis_url, socket_timeout=60), gate="np",
                             config=config(redis_timeout_s=0.5))
        admin.execute_command("CLIENT", "PAUSE", str(PAUSE_MS), "ALL")
        t0 = time.monotonic()
        n = await asyncio.wait_for(g.num_preempted("s"), 60)
        took = time.monotonic() - t0
        assert n == 0 and took < PAUSE_MS / 1000 - 3, took
        await asyncio.sleep(PAUSE_MS / 1000 - took + 0.5)
        await g.aclose()

    try:
        asyncio.run(main())
    finally:
        admin.close()


def test_sync_gate_warns_about_a_client_without_a_bound():
    with pytest.warns(RuntimeWarning, match="socket_timeout=None"):
        kvgate.Gate(redis.Redis(host="127.0.0.1", port=1, socket_timeout=None), gate="g")
    with pytest.warns(RuntimeWarning, match="retries"):
        kvgate.Gate(redis.Redis(host="127.0.0.1", port=1, socket_timeout=1.0), gate="g")
    from redis.backoff import NoBackoff
    from redis.retry import Retry
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kvgate.Gate(redis.Redis(host="127.0.0.1", port=1, socket_timeout=1.0, retry=Retry(NoBackoff(), 0)), gate="g")
        kvgate.Gate.from_url("redis://127.0.0.1:1/0", gate="g")
        kvgate.Gate(fakeredis.FakeRedis(), gate="g")


def test_sync_waiters_poll_when_pubsub_cannot_start(clock, monkeypatch):
    # a waiter whose subscription fails must not re-run acquire in a tight loop
    g = kvgate.Gate(fakeredis.FakeRedis(server=fakeredis.FakeServer()), gate="g",
                    config=kvgate.GateConfig(max_wait_s=1.0, wait_poll_s=0.25))
    g.write_snapshot(engines(usage=0.99))
    calls = {"sub": 0, "acq": 0}

    def broken_pubsub(**kw):
        calls["sub"] += 1
        raise redis.ConnectionError("no pub/sub here")
    monkeypatch.setattr(g.redis, "pubsub", broken_pubsub)
    real = g._eval

    def counting(op):
        calls["acq"] += op.script == "acquire"
        return real(op)
    monkeypatch.setattr(g, "_eval", counting)
    lease = g.acquire("s", prompt_tokens=10, max_new_tokens=0)
    assert lease.reason == "aged"
    # about one re-check per poll over max_wait_s (1 s / 0.25 s), not thousands
    assert calls["acq"] <= 12 and calls["sub"] <= 6, calls  # one resubscribe try per poll at most


def test_cluster_clients_from_url_do_not_retry_timeouts():
    # RedisCluster retries timeouts 10 times with backoff by default (~14 s per call on a
    # stalled primary); from_url's clients get redis_timeout_s and no retries, as the plain one
    import redis.asyncio.cluster as acluster
    seen = {}

    def fake(cls_name):
        def from_url(url, **kw):
            seen[cls_name] = kw
            raise RuntimeError("stop here")  # no cluster to connect to: the kwargs are what counts
        return from_url

    orig_sync, orig_async = redis.RedisCluster.from_url, acluster.RedisCluster.from_url
    redis.RedisCluster.from_url, acluster.RedisCluster.from_url = fake("sync"), fake("async")
    try:
        for cls in (kvgate.Gate, kvgate.AsyncGate):
            with pytest.raises(RuntimeError, match="stop here"):
                cls.from_url("redis://127.0.0.1:7000/0", gate="g", cluster=True)
    finally:
        redis.RedisCluster.from_url, acluster.RedisCluster.from_url = orig_sync, orig_async
    for kw in seen.values():
        assert kw["retry"].get_retries() == 0 and kw["socket_timeout"] == 1.0
    assert set(seen) == {"sync", "async"}


# -- deferred give-backs survive what interrupts them, and close() sends them -------------
def test_a_cluster_that_cannot_be_reached_degrades_and_defers(clock):
    # redis-py's RedisClusterException ("Redis Cluster cannot be connected") is a plain
    # Exception, not a RedisError: it escaped acquire and release into the agent loop, and the
    # release was lost (its lease stayed charged until lease_ttl_s)
    from redis.exceptions import RedisClusterException
    g = sync_gate(clock)
    g.write_snapshot(engines())
    g.redis.before_exc = RedisClusterException
    lease = g.acquire("a", prompt_tokens=10, max_new_tokens=0, **PLAIN)  # admitted, then the cluster goes
    g.redis.fail_before = 1
    assert lease.release() is not None  # no exception
    assert g.deferred_count == 1 and ledger(g) == 10
    close_breaker(g)
    g.redis.fail_before = 1
    assert g.acquire("b", prompt_tokens=10, max_new_tokens=0, **PLAIN).reason == "degraded"

    async def go():
        server = fakeredis.FakeServer()
        ag = kvgate.AsyncGate(AsyncFlakyRedis(server=server), gate="g",
                              config=kvgate.GateConfig(**FAST), clock_ms=clock)
        await ag.write_snapshot(engines())
        ag.redis.before_exc = RedisClusterException
        lease = await ag.acquire("a", prompt_tokens=10, max_new_tokens=0, **PLAIN)
        ag.redis.fail_before = 1
        await lease.release()
        assert ag.deferred_count == 1
        ag._flows._breaker_until = 0.0
        ag.redis.fail_before = 1
        assert (await ag.acquire("b", prompt_tokens=10, max_new_tokens=0, **PLAIN)).reason == "degraded"
        await ag.aclose()

    asyncio.run(go())


def test_a_flush_interrupted_by_anything_keeps_what_it_took(clock):
    g = three_released_while_down(clock)
    close_breaker(g)
    g.redis.before_exc = KeyboardInterrupt
    g.redis.fail_before = 1
    with pytest.raises(KeyboardInterrupt):
        g._run(g._flows.flush())  # (the unit: an acquire's own cleanup would flush again at once)
    assert g.deferred_count == 3 and ledger(g) == 30  # none lost; sent at the next call
    g.redis.before_exc = redis.ConnectionError
    g.acquire("t", prompt_tokens=1, max_new_tokens=0, **PLAIN).release()
    assert g.deferred_count == 0 and ledger(g) == 0


def test_close_sends_what_was_deferred_and_never_subscribes_again(clock):
    server = fakeredis.FakeServer()
    g = kvgate.Gate(FlakyRedis(server=server), gate="g", config=kvgate.GateConfig(**FAST), clock_ms=clock)
    g.write_snapshot(engines())
    leases = [g.acquire(f"s{i}", prompt_tokens=10, max_new_tokens=0, **PLAIN) for i in range(3)]
    g._flows.trip()
    for lease in leases:
        lease.release()
    assert g.deferred_count == 3
    close_breaker(g)  # Redis is back by the time the process closes its gate
    g.close()
    assert int(fakeredis.FakeRedis(server=server).hget(g.key("ledger"), "reserved") or 0) == 0
    assert g._listener.ensure_started() is False  # a waiter still polling must not resubscribe

    async def go():
        ag = kvgate.AsyncGate(fakeredis.aioredis.FakeRedis(server=server), gate="g",
                              config=kvgate.GateConfig(**FAST), clock_ms=clock)
        await ag.aclose()
        assert ag._listener.ensure_started() is False

    asyncio.run(go())
