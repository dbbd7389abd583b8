"""kvgate/control/call_threads.py alone: the poller's threads for its blocking Redis calls."""
from __future__ import annotations

import asyncio
import threading

import pytest
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvgate.control.call_threads import CallThreads
from _httphelpers import wait_until


def test_a_call_returns_what_the_function_returns_or_raises():
    ct = CallThreads(bound_s=5.0)
    assert ct.call_blocking(lambda a, b: a + b, 2, 3) == 5
    assert asyncio.run(ct.call(lambda: "x")) == "x"

    def fails():
        raise RedisError("no")

    with pytest.raises(RedisError, match="no"):
        ct.call_blocking(fails)
    with pytest.raises(RedisError, match="no"):
        asyncio.run(ct.call(fails))


def test_a_call_past_its_bound_is_a_redis_timeout_and_the_next_call_gets_another_thread():
    ct = CallThreads(bound_s=0.05)
    release = threading.Event()
    try:
        with pytest.raises(RedisTimeoutError, match="wait did not return within 0.05s"):
            ct.call_blocking(release.wait, 60)
        with pytest.raises(RedisTimeoutError, match="wait did not return"):
            asyncio.run(ct.call(release.wait, 60))
        ct.bound_s = 20.0  # a bound far above any answer: the claim is "served", not a speed
        assert ct.call_blocking(lambda: "served") == "served"  # two threads are stuck, a third serves
    finally:
        release.set()


def test_calls_waiting_for_a_thread_are_bounded_too():
    ct = CallThreads(bound_s=0.05, max_threads=1, backlog=2)
    started, release = threading.Event(), threading.Event()
    ran: list[int] = []

    def stuck():
        started.set()
        release.wait(60)

    try:
        with pytest.raises(RedisTimeoutError):
            ct.call_blocking(stuck)
        assert started.wait(20)  # the only thread is now stuck in it
        for i in range(2):  # these wait in the queue until their callers give up
            with pytest.raises(RedisTimeoutError, match="did not return"):
                ct.call_blocking(ran.append, i)
        with pytest.raises(RedisTimeoutError, match="still waiting for a thread"):
            ct.call_blocking(ran.append, 2)  # the backlog is full: fails at once
    finally:
        release.set()
    ct.bound_s = 20.0

    def again():
        try:
            return ct.call_blocking(lambda: "again")
        except RedisTimeoutError:  # the thread is still dropping the abandoned calls
            return None

    assert wait_until(again, timeout=20) == "again"
    assert ran == []  # the calls whose callers gave up were dropped, not run late
