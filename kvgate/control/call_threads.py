"""The poller's own threads for its blocking Redis calls, each waited for at most a bound.

The poller drives a synchronous ``kvgate.Gate`` (redis-py) from a coroutine, maybe inside an
application's event loop (``Poller.arun``, the bench).  Every Redis call it makes (the lease,
the budget reading, the snapshot write, housekeeping, ``Poller.release`` and
``Poller.leader_identity``) runs on a thread here, so that loop never stops for a Redis round
trip, and its caller waits ``bound_s`` at most: a call that has not answered by then fails as
``redis.exceptions.TimeoutError`` (a failed Redis call, like any other) and is left to its
thread.  docs/poller.md#running-it says why these are not the event loop's default executor.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from typing import Any

from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = ["CallThreads"]


class CallThreads:
    """A few daemon threads of one poller for its blocking Redis calls (synchronous redis-py).

    Not the event loop's default executor: ``asyncio.to_thread`` and the loop's getaddrinfo
    (httpx / anyio resolve engine host names there) share it, so slow DNS for a down engine
    could queue the lease behind it past the TTL.  A call that never returns (a client without
    a socket timeout on a Redis that stopped answering) keeps its thread; the caller stops
    waiting at ``bound_s``, the next call gets another thread (up to ``max_threads``), and when
    ``backlog`` calls are already waiting a new one fails at once.  Daemon threads, so a stuck
    call never holds up the process's exit; idle ones end after ``idle_s``."""

    def __init__(self, bound_s: float, max_threads: int = 4, backlog: int = 8, idle_s: float = 30.0) -> None:
        self.bound_s = bound_s
        self.max_threads, self.backlog, self.idle_s = max_threads, backlog, idle_s
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0
        self._queued = 0

    async def call(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` on a call thread, awaited for ``bound_s`` at most (then
        ``redis.exceptions.TimeoutError``)."""
        fut = self._submit(fn, *args)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), self.bound_s)
        except asyncio.TimeoutError:
            fut.cancel()
            raise self._late(fn) from None

    def call_blocking(self, fn: Any, *args: Any) -> Any:
        """:meth:`call` for a caller outside the event loop: blocks ``bound_s`` at most."""
        fut = self._submit(fn, *args)
        try:
            return fut.result(timeout=self.bound_s)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise self._late(fn) from None

    def _late(self, fn: Any) -> RedisTimeoutError:
        return RedisTimeoutError(f"{getattr(fn, '__name__', 'redis call')} did not return within "
                                 f"{self.bound_s:.2f}s")

    def _submit(self, fn: Any, *args: Any) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._queued >= self.backlog:
                raise RedisTimeoutError(f"{self._queued} Redis calls of the poller are still waiting "
                                        "for a thread (Redis does not answer)")
            self._queued += 1
            self._q.put((fut, fn, args))
            if self._queued > self._idle and self._threads < self.max_threads:
                self._threads += 1
                threading.Thread(target=self._work, name="kvgate-poller-redis", daemon=True).start()
        return fut

    def _work(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            try:
                item = self._q.get(timeout=self.idle_s)
            except queue.Empty:
                with self._lock:
                    self._idle -= 1
                    if self._queued == 0:
                        self._threads -= 1
                        return
                continue
            with self._lock:
                self._idle -= 1
                self._queued -= 1
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue  # its caller stopped waiting before it started
            try:
                r = fn(*args)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)
            else:
                fut.set_result(r)
