"""One representative run of a deployment's Redis calls, for the tests of how kvgate reaches
Redis (an ACL user, TLS): a poller tick, the turns of a gate (sync or async, the ``driver``
fixture), ``status``. The same body over every way in, so each proves the whole surface."""
from __future__ import annotations

import threading
import time

import pytest

import kvgate
from kvgate.control.poller import Poller
from kvgate.tools.sim import SimCluster

from _gatehelpers import HANG_S, config, result_within
from _simhelpers import SMALL


def wait_for_waiters(gate: kvgate.Gate, n: int) -> None:
    """Until ``n`` turns wait in the FIFO (bounded: a hang fails the test)."""
    deadline = time.monotonic() + HANG_S
    while time.monotonic() < deadline:
        if gate.status()["waiting"] == n:
            return
        time.sleep(0.05)
    pytest.fail(f"{n} waiter(s) never showed up in the FIFO")


def core_flow(driver, url: str, name: str = "deploy") -> None:
    """What a deployment does over ``url``: a poller tick writes a snapshot from a simulated
    engine; turns of ``driver``'s gate are admitted, queued, granted when a finished session
    frees its tokens, cancelled and finished; ``status`` (through the sync gate the poller
    uses) reads the ledger back empty and nothing is left deferred."""
    # no aging, and one tick's snapshot stays fresh, for as long as the test may take
    cfg = config(max_wait_s=60.0, max_wait_hard_s=120.0, staleness_s=60.0)
    ops = kvgate.Gate.from_url(url, gate=name, config=cfg)
    gate = driver.from_url(url, gate=name, config=cfg)
    with SimCluster(1, time_scale=0.0, router=False, **SMALL) as sim:
        try:
            tick = Poller(ops, engines=sim.engine_urls).tick()
            assert tick.leader and tick.wrote, tick.reason
            ceiling = ops.status()["ceiling"]
            assert ceiling > 0
            half = dict(prompt_tokens=int(ceiling * 0.3), max_new_tokens=int(ceiling * 0.3))  # 60%: one at a time

            a = driver(gate.acquire("s1", **half))
            assert a.outcome == "admit", a
            waiting = driver.start(gate.acquire, "s2", **half)
            wait_for_waiters(ops, 1)
            driver(a.release())  # s1's window keeps its tokens (idle) until the session ends
            assert driver(gate.finish_session("s1"))["session_id"] == "s1"
            b = result_within(waiting, HANG_S, "the queued acquire")
            assert b.outcome == "admit", b  # the grant of the freed tokens reached it

            abort = threading.Event()
            cancelled = driver.start(gate.acquire, "s3", abort_event=abort, **half)
            wait_for_waiters(ops, 1)
            abort.set()
            with pytest.raises(kvgate.AdmissionCancelled):
                result_within(cancelled, HANG_S, "the aborted acquire")

            driver(b.release())
            for sid in ("s2", "s3"):
                assert "error" not in driver(gate.finish_session(sid))
            st = ops.status()
            assert (st["reserved"], st["leases"], st["waiting"], st["windows"]) == (0, 0, 0, 0), st
            assert not gate.deferred_count  # every release and cancel reached Redis
        finally:
            driver.close(gate)
            ops.close()
