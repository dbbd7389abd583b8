"""What an uncontended turn asks of Redis (issue: a turn costs what it must), counted on a
real redis-server by ``INFO commandstats``: two script calls, the ledger read once and
written once per call, one counter command per event, and no reap while no deadline has
passed. Counts are properties of the code; no latency is asserted here (benchmarks/overhead.py
measures those). Also the ledger's ``due_ms`` (lua/includes/common.lua ``deadline``) and the
step window read as totals less their values at the step's start (lua/drain_stats.lua).
"""
from __future__ import annotations

import pytest
import redis

import kvgate
from _gatehelpers import Clock, engines, stat

pytestmark = pytest.mark.redis_real

PROMPT = list(range(3, 3 + 2000))


def commands(r: redis.Redis) -> dict[str, int]:
    return {k[len("cmdstat_"):]: v["calls"] for k, v in r.info("commandstats").items()}


def gate_on(url: str, clock: Clock | None = None) -> kvgate.Gate:
    g = kvgate.Gate(redis.Redis.from_url(url, socket_timeout=5), gate="hot",
                    config=kvgate.GateConfig(), clock_ms=clock)
    g.write_snapshot(engines(cap=1_000_000))
    return g


def test_an_uncontended_turn_is_two_calls_one_ledger_read_and_write_each_and_no_reap(redis_url):
    g = gate_on(redis_url)
    for _ in range(3):  # the session's window opens on its first turn
        g.acquire("s", prompt_ids=PROMPT, max_new_tokens=50).release()
    g.redis.config_resetstat()
    lease = g.acquire("s", prompt_ids=PROMPT, max_new_tokens=50)
    lease.release()
    c = commands(g.redis)
    assert lease.reason == "reserved_session"
    assert c.get("fcall") == 2 and "evalsha" not in c  # the function library, loaded once
    assert "info" not in c  # the server's run_id is read once per server process
    assert c.get("hgetall") == 2 and c.get("hset", 0) >= 2  # one ledger read and write per call
    assert "zrangebyscore" not in c  # nothing past its deadline: no reap
    assert c.get("hincrby", 0) + c.get("hincrbyfloat", 0) <= 4  # two events each, counted once
    g.close()


def test_due_ms_is_never_after_a_deadline_and_a_passed_one_is_reaped(redis_url):
    clock = Clock()
    g = gate_on(redis_url, clock)
    r = g.redis
    due = lambda: r.hget(g.key("ledger"), "due_ms").decode()  # noqa: E731
    lease = g.acquire("a", prompt_ids=PROMPT, max_new_tokens=50)
    exp = r.zscore(g.key("lease_exp"), lease.ticket)
    assert float(due()) <= exp
    lease.release()  # the window goes idle: its grace is the earliest deadline now
    win_exp = r.zscore(g.key("window_exp"), "a")
    assert float(due()) <= win_exp
    # past the window's grace, the next turn's call reaps it (as the poller's housekeep would)
    clock.advance((win_exp - clock() + 1) / 1000)
    g.acquire("b", prompt_ids=PROMPT, max_new_tokens=50).release()
    assert r.hget(g.key("windows"), "a") is None
    assert stat(g, "window_expired") == 1
    # with every deadline gone, nothing is due until the next one is set
    r.delete(g.key("lease_exp"), g.key("window_exp"), g.key("alive"), g.key("windows"))
    r.hdel(g.key("ledger"), "due_ms")  # unknown: the next call reaps and reads it afresh
    g.housekeep()
    assert due() == "none"
    g.close()


def test_the_step_window_is_totals_less_the_steps_start(redis_url):
    g = gate_on(redis_url)
    for _ in range(3):
        g.acquire("s", prompt_ids=PROMPT, max_new_tokens=50).release()
    m = g.step_metrics()
    assert m["agentic_kv/admission/admit"] == 3
    g.acquire("s", prompt_ids=PROMPT, max_new_tokens=50).release()
    assert g.step_metrics(drain=False)["agentic_kv/admission/admit"] == 1
    assert int(g.redis.hget(g.key("totals"), "admit")) == 4
    # counters whose totals were lost (a restore without them) count from zero, not below it
    g.redis.delete(g.key("totals"))
    g.acquire("s", prompt_ids=PROMPT, max_new_tokens=50).release()
    assert g.step_metrics()["agentic_kv/admission/admit"] == 1
    g.close()
