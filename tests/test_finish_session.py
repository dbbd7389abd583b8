"""finish_session: it stops the session's waiting attempt, joins the session's turns that end
within close_timeout_s and aborts the rest, never waits for the turn it is called from, and
sends /close_session to the engines, counting a close that reaches no engine (the breaker
open, an engine list that cannot be read, a malformed URL) as a failed one. Both gates
alike where both are driven (the ``driver`` fixture)."""
from __future__ import annotations

import threading
import time

import fakeredis
import redis

import kvgate

from _gatehelpers import engines, mkgate, script

NOWHERE = ("http://127.0.0.1:9",)  # nothing listens there: a close fails at once


def test_finish_session_joins_turns_that_end_and_aborts_the_rest(driver):
    g = driver.gate(session_lifecycle=True, close_timeout_s=0.5, engine_urls=NOWHERE)
    driver(g.write_snapshot(engines()))
    ends = threading.Event()
    quick = driver.hold_turn(g, "s", ends)
    threading.Timer(0.1, ends.set).start()
    out = driver(g.finish_session("s"))
    assert (out["joined"], out["aborted"]) == (1, 0) and quick.result(10) == "ended"
    assert out["close"] == {"attempts": 1, "failures": 1}
    never = threading.Event()
    stuck = driver.hold_turn(g, "t", never)
    out = driver(g.finish_session("t"))
    assert (out["joined"], out["aborted"]) == (0, 1)
    if driver.kind == "async":
        assert stuck.result(10) == "cancelled"  # its task was cancelled (the lease given back)
    else:
        assert not stuck.done()  # a thread cannot be stopped from outside: it goes on
        never.set()
        assert stuck.result(10) == "ended"
    assert int(driver(g.redis.hlen(g.key("leases")))) == 0
    driver.close(g)


def test_finish_session_inside_its_own_turn_does_not_wait_for_itself(driver, clock):
    g = driver.gate(clock=clock, session_lifecycle=True, close_timeout_s=30.0, engine_urls=("http://127.0.0.1:1",))
    driver(g.write_snapshot(engines()))
    t0 = time.monotonic()
    out = driver.turn(g, "s", lambda lease: g.finish_session("s"), prompt_tokens=10, max_new_tokens=0)
    assert (out["joined"], out["aborted"]) == (0, 0)
    # the close to port 1 fails fast (refused); a wait for the caller's own turn would last the
    # whole close_timeout_s (30 s): half of it tells the two apart on any box
    assert time.monotonic() - t0 < 15.0
    assert out["close"] == {"attempts": 1, "failures": 1}
    driver.close(g)


def test_lifecycle_join_ignores_turns_released_by_hand(backend, clock):
    # acquire()/release() without turn(): nothing stays "in flight" for finish_session to join
    g = mkgate(backend, clock, session_lifecycle=True, close_timeout_s=5.0)
    g.write_snapshot(engines())
    g.acquire("s", prompt_tokens=10, max_new_tokens=1).release()
    with g.turn("s", prompt_tokens=12, max_new_tokens=1):
        pass
    out = g.finish_session("s")
    assert (out["joined"], out["aborted"]) == (0, 0) and out["close"]["attempts"] == 1  # one engine URL in the snapshot


def test_finish_session_stops_its_waiting_attempt(backend, clock):
    g = mkgate(backend, clock)
    g.write_snapshot(engines(usage=0.95))
    assert script(g, "acquire", ticket="t", session="s", need=1, probe=-2)["o"] == "wait"
    assert g.finish_session("s")["stopped"] == "t"
    r = script(g, "acquire", ticket="t", session="s", need=1, probe=-2)
    assert (r["o"], r["r"]) == ("preempted", "session_finished")


def test_a_close_is_sent_while_the_breaker_is_open(driver):
    # the engine list is read past the breaker: one failed call a moment ago must not send a
    # session's /close_session to no engine (and count nothing)
    g = driver.gate(gate="cb", session_lifecycle=True, close_timeout_s=2.0)
    driver(g.write_snapshot([kvgate.EngineState("http://127.0.0.1:9", capacity_tokens=1000, usage=0.1, healthy=True,
                                                url="http://127.0.0.1:9")]))  # nothing listens there
    g._flows.trip()
    out = driver(g.finish_session("s"))
    assert out["close"] == {"attempts": 1, "failures": 1}
    driver.close(g)


def test_an_engine_list_that_cannot_be_read_is_a_counted_failure():
    g = mkgate(fakeredis.FakeRedis, gate="cf", session_lifecycle=True, close_timeout_s=2.0)

    def down(*a, **kw):
        raise redis.ConnectionError("Redis went away")
    g.redis.hget = down
    out = g.finish_session("s")
    assert out["close"]["failures"] == 1 and out["close"]["attempts"] == 1


def test_finish_session_counts_a_malformed_snapshot_url_as_a_failed_close(clock):
    g = kvgate.Gate(fakeredis.FakeRedis(), gate="g", clock_ms=clock,
                    config=kvgate.GateConfig(session_lifecycle=True, close_timeout_s=0.5))
    g.write_snapshot(engines())
    # a snapshot written by an older client, with a URL this version refuses
    g.redis.hset(g.key("snapshot"), "engines", '[{"url": "10.0.0.5:30000"}]')
    out = g.finish_session("s")  # no ValueError into the agent loop
    assert out["close"] == {"attempts": 1, "failures": 1}
