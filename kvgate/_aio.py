"""asyncio helpers shared by the async client, the integrations, the simulator and the bench.

``wait_for``: ``asyncio.wait_for`` on Python 3.10 and 3.11 can swallow a cancellation that
arrives in the same loop iteration as the awaited result (CPython gh-86296, fixed in 3.12
by reimplementing it on ``asyncio.timeout``). A swallowed cancel is a task that goes on
running after its owner stopped it: the bench's sampler once kept a finished run open for
eleven minutes that way. On 3.11+ we use ``asyncio.timeout``, which keeps the cancel; 3.10
has no ``asyncio.timeout`` and keeps the stdlib behaviour.
"""
from __future__ import annotations

import asyncio
import sys
from typing import Any, Awaitable, TypeVar

T = TypeVar("T")

if sys.version_info >= (3, 11):
    async def wait_for(aw: Awaitable[T], timeout: float | None) -> T:
        """Await ``aw`` for at most ``timeout`` seconds (``asyncio.TimeoutError`` after);
        a cancellation of the caller is never lost."""
        async with asyncio.timeout(timeout):
            return await aw
else:  # pragma: no cover - exercised on 3.10 only
    def wait_for(aw: Awaitable[Any], timeout: float | None) -> Awaitable[Any]:
        return asyncio.wait_for(aw, timeout)
