"""The poller's leader lease: which one of a gate's pollers writes snapshots and housekeeps.

A ``redis.lock.Lock`` (redis-py's own; non-blocking, not thread-local) on
``kvgate:{gate}:poller_leader`` with ``timeout = ttl_s``, whose token is the poller's identity
(``host:pid:random``), so ``redis-cli GET`` shows the leader.  The leader extends it at the
start of each tick, after discovery and right before writing (the fence), and a task extends
it every ``ttl_s / 3`` while the tick runs; a standby tries to take it each tick.  Every Redis
call goes through the poller's ``CallThreads`` and its bound.  docs/poller.md#high-availability
has the reasons and the race that remains.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from redis.exceptions import LockError, RedisError

from kvgate import keys
from kvgate.client import access
from kvgate.control.call_threads import CallThreads
from kvgate.errors import RedisAccessDenied

# the poller's logger, not this module's: all a poller says is filed under that one name (as
# kvgate/cli.py's own lines about it are), for operators to filter and set levels by
log = logging.getLogger("kvgate.control.poller")

__all__ = ["LeaderLease", "leader_key"]

_monotonic = time.monotonic  # the lease's own clock for "held" (tests replace it)


def leader_key(gate_name: str) -> str:
    return keys.key(gate_name, "poller_leader")


class LeaderLease:
    """One poller's side of the lease: take, extend, keep alive while a tick runs, release.

    ``is_leader`` is the answer of the last take-or-extend; ``held`` also requires that the
    TTL has not run out since, on this poller's own clock.  ``changes`` counts the times this
    poller gained or lost the lease."""

    def __init__(self, redis_client: Any, gate_name: str, *, identity: str, ttl_s: float,
                 calls: CallThreads) -> None:
        self.redis = redis_client
        self.key = leader_key(gate_name)
        self.identity = identity
        self.ttl_s = ttl_s
        self.calls = calls
        self.lock = redis_client.lock(self.key, timeout=ttl_s, blocking=False, thread_local=False)
        self.is_leader = False
        self.changes = 0
        self._until = 0.0  # _monotonic() time by which the lease surely ran out

    def _take_or_extend(self) -> bool:
        """The Redis side of :meth:`hold` (runs on a call thread; touches no lease state):
        extend the lease if we hold it, else try to take it."""
        if getattr(self.lock.local, "token", None) is not None:
            # We held it at some point: extending checks the token atomically, so this also
            # keeps a lease we still own after a Redis blip made us think we lost it.
            try:
                self.lock.extend(self.ttl_s, replace_ttl=True)
                return True
            except LockError:
                pass  # expired (we stalled) or taken over
        return bool(self.lock.acquire(blocking=False, token=self.identity))

    async def hold(self) -> bool:
        """Extend or take the lease.  Redis faults, and calls slower than the call threads'
        bound, -> not leader."""
        was = self.is_leader
        t0 = _monotonic()
        try:
            got = await self.calls.call(self._take_or_extend)
        except RedisError as e:
            if access.is_refusal(e):
                # a poller that stayed a standby on it would never write, and say only why
                # in a warning per tick: the ACL is wrong, so stop (docs/deploy.md#acl)
                raise RedisAccessDenied(f"poller {self.identity}: Redis refused the leader lease on "
                                        f"{self.key}: {type(e).__name__}: {e}. Grant the ACL in "
                                        f"docs/deploy.md#acl", e) from e
            log.warning("leader lease: redis error: %s", e)
            got = False
        if got:
            self._until = t0 + self.ttl_s
        self.is_leader = got
        if got != was:
            self.changes += 1
            log.info("poller %s is now %s", self.identity, "LEADER" if got else "standby")
        return got

    def _extend(self) -> None:
        self.lock.extend(self.ttl_s, replace_ttl=True)  # LockError: not ours any more

    async def keep_alive(self) -> None:
        """Extend the lease every ``ttl_s / 3`` while the leader's tick runs (a task the tick
        cancels when it ends): scraping alone can take ``ceil(engines / concurrency)`` request
        deadlines, longer than the TTL, and a lease that lapsed mid-tick lets a standby take
        it, whose own long tick then loses it the same way (no poller would ever write).  Only
        extends, never takes: a lease that is no longer ours stays lost, and the fence before
        the write refuses to write."""
        period = self.ttl_s / 3
        while True:
            await asyncio.sleep(period)
            t0 = _monotonic()
            try:
                await self.calls.call(self._extend)
            except LockError:
                self._until = 0.0
                return
            except RedisError as e:
                log.debug("leader lease: keep-alive failed: %s", e)
                continue
            self._until = t0 + self.ttl_s

    @property
    def held(self) -> bool:
        """Leader at the last check, and the lease's TTL has not run out since on this
        poller's own clock (a poller that stalled past it may have lost the lease)."""
        return self.is_leader and _monotonic() < self._until

    def holder(self) -> str | None:
        """Who holds the lease (``host:pid:random``), or None (none, or Redis did not answer
        within the call threads' bound)."""
        try:
            v = self.calls.call_blocking(self.redis.get, self.key)
        except RedisError:
            return None
        return v.decode() if isinstance(v, bytes) else v

    def _release(self) -> None:
        if getattr(self.lock.local, "token", None) is not None:
            try:
                self.lock.release()  # a no-op error if the lease is no longer ours
            except (LockError, RedisError):
                pass

    async def arelease(self) -> None:
        """:meth:`release` for the event loop (``Poller.arun``'s way out)."""
        self.is_leader = False
        self._until = 0.0
        try:
            await self.calls.call(self._release)
        except RedisError as e:
            log.warning("leader lease: not released (%s): it expires within %.1fs", e, self.ttl_s)

    def release(self) -> None:
        """Give up the lease at once (graceful shutdown: a standby takes over next tick).
        Bounded by the call threads' bound; on a Redis that does not answer, the lease is
        left to expire."""
        self.is_leader = False
        self._until = 0.0
        try:
            self.calls.call_blocking(self._release)
        except RedisError as e:
            log.warning("leader lease: not released (%s): it expires within %.1fs", e, self.ttl_s)
