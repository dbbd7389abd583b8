"""kvgate._aio.wait_for keeps a cancellation that lands as the awaited call completes.

asyncio.wait_for on Python <= 3.11 returns the inner result and drops such a cancel
(CPython gh-86296); a task cancelled that way runs on. The bench's sampler did exactly that
once and held a finished run open for eleven minutes.
"""
import asyncio
import sys

import pytest

from kvgate._aio import wait_for


async def _race(waiter) -> str:
    """Cancel a task in the same loop iteration as the call it awaits completes."""
    fut = asyncio.get_running_loop().create_future()

    async def inner():
        return await fut

    async def outer():
        await waiter(inner(), 10.0)
        await asyncio.sleep(0.2)  # only reached when the cancel was swallowed
        return "ran on after cancel"

    task = asyncio.create_task(outer())
    for _ in range(3):  # let wait_for start the inner call
        await asyncio.sleep(0)
    fut.set_result(1)
    task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        return "cancelled"


def test_wait_for_keeps_a_cancel_that_races_completion():
    assert asyncio.run(_race(wait_for)) == "cancelled"


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="the stdlib race is fixed in 3.12")
def test_the_stdlib_race_is_real_here():
    # documents why kvgate does not use asyncio.wait_for: on this Python it loses the cancel
    assert asyncio.run(_race(asyncio.wait_for)) == "ran on after cancel"


def test_wait_for_times_out_and_returns_results():
    async def main():
        assert await wait_for(asyncio.sleep(0, result=7), 1.0) == 7
        with pytest.raises(asyncio.TimeoutError):
            await wait_for(asyncio.sleep(5), 0.05)
    asyncio.run(main())
