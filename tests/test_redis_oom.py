"""A Redis out of memory (``maxmemory`` reached, policy ``noeviction``): turns fail open.

Redis then refuses every script whose first write could grow memory (``OOM command not
allowed when used memory > 'maxmemory'``); the gate treats that as a fault like any other:
turns bypass as ``degraded`` and never raise, waiters leave as ``degraded``, releases are
kept to send later, one warning line says what is wrong (not one per turn), and once memory
frees (keys deleted, or ``maxmemory`` raised) gating resumes by itself with the ledger
exactly the live charges: nothing negative, nothing admitted twice. Each test starts its own
redis-server with a small ``maxmemory``; filler keys outside the gate's namespace take the
rest. Both gates alike (the ``driver`` fixture).
"""
from __future__ import annotations

import logging
import signal
import time

import pytest
import redis

import kvgate
from kvgate.client.flows import BREAKER_S

from _gatehelpers import HANG_S, engines, ledger_consistent
from _httphelpers import wait_until
from conftest import start_redis

pytestmark = pytest.mark.redis_real

MAXMEMORY = 8 * 1024 * 1024
FILLER = b"x" * 65536
MARGIN = 1024 * 1024
HOLD = dict(prompt_tokens=800, max_new_tokens=0)   # of a 900-token ceiling: nothing else fits
SMALL = dict(prompt_tokens=10, max_new_tokens=5)


@pytest.fixture
def small_redis():
    rp = start_redis(None, "--maxmemory", str(MAXMEMORY), "--maxmemory-policy", "noeviction")
    yield rp
    rp.stop(signal.SIGKILL)


def fill(r: redis.Redis) -> None:
    """Write filler keys until Redis refuses one for memory, then put maxmemory a margin below
    what is used: at the limit itself, a client's buffers freed a moment later bring Redis
    back under it, and a script would run or not by chance."""
    for i in range(4 * MAXMEMORY // len(FILLER)):
        try:
            r.set(f"filler:{i}", FILLER)
        except redis.exceptions.OutOfMemoryError:
            r.config_set("maxmemory", int(r.info("memory")["used_memory"]) - MARGIN)
            return
    raise AssertionError(f"Redis never refused a write: is maxmemory {MAXMEMORY} in force?")


def oom_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "kvgate" and r.levelno == logging.WARNING and "out of memory" in r.getMessage()]


@pytest.mark.parametrize("relief", ["delete keys", "raise maxmemory"])
def test_turns_fail_open_while_redis_is_out_of_memory_and_resume_after(small_redis, driver, caplog, relief):
    caplog.set_level(logging.WARNING, logger="kvgate")
    cfg = kvgate.GateConfig(redis_timeout_s=1.0, wait_poll_s=0.2, max_wait_s=30.0, staleness_s=600.0,
                            idle_grace_s=0.0, expected_decode_cap=None)
    g = driver.from_url(small_redis.url, gate="oom", config=cfg)
    r = small_redis.client()
    try:
        driver(g.write_snapshot(engines(cap=1000)))
        holder = driver.call(g.acquire, "holder", **HOLD)
        assert (holder.outcome, holder.reason) == ("admit", "open")
        waiter = driver.start(g.acquire, "waiter", **HOLD)
        wait_until(lambda: r.zcard(g.key("fifo")) == 1, timeout=HANG_S, what="the waiter to queue")
        before = ledger_consistent(r, g)

        fill(r)
        # the waiter's next re-check is refused: it leaves as degraded, never raises
        lease = waiter.result(timeout=HANG_S)
        assert (lease.outcome, lease.reason) == ("bypass", "degraded")
        turns = [driver.call(g.acquire, f"s{i}", **SMALL) for i in range(20)]
        assert {(t.outcome, t.reason) for t in turns} == {("bypass", "degraded")}
        assert driver.call(holder.release) is False        # kept to send later
        assert "error" in driver.call(g.finish_session, "s0")
        assert driver.call(g.step_metrics, False)["agentic_kv/budget/degraded"] == 1.0
        assert ledger_consistent(r, g) == before           # nothing charged, nothing lost
        assert len(oom_warnings(caplog)) == 1, caplog.text  # one line, not one per turn
        assert "noeviction" in oom_warnings(caplog)[0]

        if relief == "delete keys":
            r.delete(*r.keys("filler:*"))
        else:
            r.config_set("maxmemory", 0)
        t_relief = time.monotonic()

        def admitted():
            lease = driver.call(g.acquire, "after", **SMALL)
            if lease.outcome == "admit":
                return lease
            driver.call(lease.release)
            return None
        after = wait_until(admitted, timeout=HANG_S + BREAKER_S, what="gating to resume")
        print(f"\nout of memory ({driver.kind}, {relief}): admitted again {time.monotonic() - t_relief:.2f} s "
              f"after memory freed")
        # the holder's release and the waiter's cancel went before that call
        assert g.deferred_count == 0
        assert r.zcard(g.key("fifo")) == 0 and not r.hexists(g.key("leases"), holder.ticket)
        assert ledger_consistent(r, g) == 15
        assert driver.call(after.release) is True
        assert ledger_consistent(r, g) == 0
        assert len(oom_warnings(caplog)) == 1
    finally:
        driver.close(g)
        r.close()
