"""The flows of kvgate/client/flows.py driven by hand: a scripted clock and scripted results
for every operation, no Redis and no driver. Each test checks the operations a flow yields
and what it returns (or raises) for one outcome."""
from __future__ import annotations

import asyncio
import json

import pytest
import redis

import kvgate
from kvgate.client import flows as F
from kvgate.client.flows import (BreakerOpen, Close, Command, Eval, GateFlows, Interrupted, Join, Listen, Pipeline,
                                 Probe, RedisDown, Wait)
from kvgate.client.lifecycle import CloseResult

from _gatehelpers import FAST, TURN


class Clock:
    """Monotonic seconds that a test moves by hand."""

    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def gate_flows(clock: Clock | None = None, **cfg) -> GateFlows:
    return GateFlows("g", kvgate.GateConfig(**{**FAST, **cfg}), clock=clock or Clock())


def returned(flow, value=None, throw: BaseException | None = None):
    """Send (or throw) the last result into a flow that must end: what it returns."""
    with pytest.raises(StopIteration) as stop:
        flow.throw(throw) if throw is not None else flow.send(value)
    return stop.value.value


def begin_acquire(f: GateFlows, has_probe: bool = False, **kw):
    """An acquire flow past its Listen: (the flow, its first Eval)."""
    flow = f.acquire("s", has_probe=has_probe, **{**TURN, **kw})
    listen = next(flow)
    assert isinstance(listen, Listen) and len(listen.ticket) == 32
    op = flow.send(None)
    assert isinstance(op, Eval) and op.script == "acquire"
    assert op.params["ticket"] == listen.ticket and op.params["session"] == "s"
    return flow, op


WAIT = {"o": "wait", "r": "queued", "w": 0, "mw": 30000}


# -- acquire ----------------------------------------------------------------------------------
def test_admit():
    f = gate_flows()
    flow, op = begin_acquire(f)
    assert {k: op.params[k] for k in ("need", "protected", "retain", "probe")} == \
        {"need": 15, "protected": 0, "retain": 1, "probe": -2}
    d = returned(flow, {"o": "admit", "r": "open", "w": 0, "t": 15, "ep": 3})
    assert (d.outcome, d.reason, d.tokens, d.epoch, d.held) == ("admit", "open", 15, 3, True)
    assert (d.session_id, d.ticket, d.turn_index) == ("s", op.params["ticket"], 0)
    assert not f.local  # Redis counted it


def test_pass_through_yields_nothing_and_is_counted_here():
    f = gate_flows()
    d = returned(f.acquire("s", has_probe=False, scope="eval", **TURN))
    assert (d.outcome, d.reason, d.held) == ("pass", "", False)
    assert f.local["pass"] == 1


def test_bypass_decided_by_the_script():
    flow, _ = begin_acquire(gate_flows(), protected=True)
    d = returned(flow, {"o": "bypass", "r": "protected", "ep": 2})
    assert (d.outcome, d.reason, d.held, d.epoch) == ("bypass", "protected", False, 2)


def test_wait_then_grant():
    clock = Clock()
    flow, first = begin_acquire(gate_flows(clock))
    wait = flow.send(WAIT)
    assert wait == Wait(0.2)  # a poll: the script's bound (30 s) and max_wait_s are further
    clock.t += 0.2
    again = flow.send("signal")
    assert again == Eval("acquire", {**first.params})  # the same attempt re-checks
    d = returned(flow, {"o": "admit", "r": "open", "w": 1500, "t": 15, "ep": 1})
    assert (d.outcome, d.waited_s) == ("admit", 1.5)


def test_a_wait_rechecks_every_poll_and_ends_at_the_hard_bound():
    # the head may age whenever the gate stops making progress: the waiter re-checks each poll,
    # and the last sleep ends just past its own max_wait_hard_s + one poll
    clock = Clock()
    flow, _ = begin_acquire(gate_flows(clock, wait_poll_s=5.0, max_wait_s=30.0, max_wait_hard_s=60.0))
    assert flow.send({"o": "wait", "r": "queued", "w": 1000}) == Wait(5.0)
    clock.t += 62.0
    assert isinstance(flow.send("timeout"), Eval)
    assert flow.send({"o": "wait", "r": "queued", "w": 62000}) == Wait(pytest.approx(3.01))


def test_preempted():
    flow, _ = begin_acquire(gate_flows())
    with pytest.raises(kvgate.Preempted) as e:
        flow.send({"o": "preempted", "r": "preempted"})
    assert e.value.session_id == "s"


def test_probe_round_trip():
    f = gate_flows(admission=False)
    flow, op = begin_acquire(f, has_probe=True, prompt_ids=[7] * 10, prompt_tokens=None)
    assert op.params["probe"] == -1  # the script may ask for a probe
    probe = flow.send({"o": "probe", "b": 123})
    assert probe == Probe("s", [7] * 10)
    back = flow.send(kvgate.ProbeResult(0.9))
    assert back.params["probe"] == 0.9 and back.params["t0"] == 123  # when the attempt began
    d = returned(flow, {"o": "admit", "r": "resident_prefix", "t": 15, "ep": 1})
    assert d.reason == "resident_prefix"


def test_probe_without_prompt_ids_is_unavailable_without_asking():
    flow, _ = begin_acquire(gate_flows(admission=False), has_probe=True)
    back = flow.send({"o": "probe"})
    assert isinstance(back, Eval) and back.params["probe"] == -2


def test_redis_down_is_degraded_and_gives_back_later():
    f = gate_flows()
    flow, op = begin_acquire(f)
    d = returned(flow, throw=RedisDown("timeout"))
    assert (d.outcome, d.reason, d.held) == ("bypass", "degraded", False)
    assert f.breaker_open() and f.local["bypass_degraded"] == 1
    assert f.deferred_count == 1  # the call may have run: its lease is given back later


def test_open_breaker_sends_nothing():
    f = gate_flows()
    f.trip()
    flow = f.acquire("s", has_probe=False, **TURN)
    assert isinstance(next(flow), Listen)
    d = returned(flow)
    assert d.reason == "degraded" and f.deferred_count == 0


def test_timeout_cancels():
    clock = Clock()
    flow, _ = begin_acquire(gate_flows(clock, max_wait_s=30.0), timeout_s=1.0)
    assert flow.send(WAIT) == Wait(0.2)
    clock.t += 1.0
    assert isinstance(flow.send("timeout"), Eval)
    cancel = flow.send(WAIT)
    assert cancel.script == "cancel" and cancel.params["degraded"] == 0
    with pytest.raises(kvgate.AdmissionTimeout):
        flow.send({"removed": "waiter"})


def test_local_clock_asks_the_script_to_age_it():
    clock = Clock()
    flow, _ = begin_acquire(gate_flows(clock, max_wait_hard_s=3.0))
    clock.t += 3.2  # max_wait_hard_s + wait_poll_s
    aged = flow.send(WAIT)
    assert aged.script == "acquire" and aged.params["age"] == 1
    d = returned(flow, {"o": "admit", "r": "aged", "w": 3200, "t": 5, "ep": 1})
    assert (d.outcome, d.reason, d.held) == ("admit", "aged", True)


def test_a_script_that_will_not_age_the_wait_fails_open():
    # (a misbehaving script clock: asked to age the attempt, it still says wait)
    clock = Clock()
    flow, _ = begin_acquire(gate_flows(clock, max_wait_hard_s=3.0))
    clock.t += 3.2
    aged = flow.send(WAIT)
    cancel = flow.send(WAIT)
    assert cancel == Eval("cancel", {"ticket": aged.params["ticket"], "degraded": 1})
    d = returned(flow, {"removed": "waiter"})
    assert (d.outcome, d.reason, d.epoch) == ("bypass", "degraded", 0)


def test_abort_racing_a_grant_gives_the_lease_back():
    flow, first = begin_acquire(gate_flows())
    assert isinstance(flow.send(WAIT), Wait)
    cancel = flow.send("abort")  # the grant landed while the waiter woke
    assert cancel == Eval("cancel", {"ticket": first.params["ticket"], "degraded": 0})
    with pytest.raises(kvgate.AdmissionCancelled):
        flow.send({"removed": "lease"})  # cancel.lua found the grant and released it


@pytest.mark.parametrize("at", ["wait", "probe", "eval"])
def test_interrupted_cancels_wherever_it_lands(at):
    f = gate_flows(admission=False)
    flow, first = begin_acquire(f, has_probe=True, prompt_ids=[1, 2], prompt_tokens=None)
    if at == "wait":
        assert isinstance(flow.send(WAIT), Wait)
    elif at == "probe":
        assert isinstance(flow.send({"o": "probe"}), Probe)
    cancel = flow.throw(Interrupted(asyncio.CancelledError()))
    assert cancel == Eval("cancel", {"ticket": first.params["ticket"]})
    with pytest.raises(Interrupted):
        flow.send({"removed": "lease"})


def test_interrupted_while_redis_is_down_defers_the_cancel():
    f = gate_flows()
    flow, first = begin_acquire(f)
    flow.send(WAIT)
    flow.throw(Interrupted(KeyboardInterrupt()))
    with pytest.raises(Interrupted):
        flow.throw(RedisDown("down"))
    assert f.deferred_count == 1 and f._deferred[first.params["ticket"]][0] == "cancel"


def test_turns_are_numbered_and_the_gap_is_sent_once():
    clock = Clock()
    f = gate_flows(clock)
    flow, op = begin_acquire(f)
    assert "gap" not in op.params and "prev_prompt" not in op.params
    returned(flow, {"o": "admit", "r": "open", "t": 15})
    f.turn_ended("s", 10)
    clock.t += 3.0
    flow, op = begin_acquire(f)
    assert op.params["gap"] == 3000.0
    assert op.params["prev_prompt"] == 10  # what the engines may still hold of this prompt
    assert isinstance(flow.send(WAIT), Wait)
    again = flow.send("timeout").params
    assert "gap" not in again and again["prev_prompt"] == 10  # re-checks do not report the gap again
    d = returned(flow, {"o": "admit", "r": "open", "t": 15})
    assert d.turn_index == 1


def test_the_script_call_carries_its_argv():
    f = GateFlows("g", kvgate.GateConfig(max_wait_s=7.0), clock=Clock(), script_clock_ms=lambda: 1234)
    op = f.eval_op("release", {"ticket": "t"})
    now, blob, knobs = op.argv
    sent, kn = json.loads(blob), json.loads(knobs)
    assert now == "1234" and sent == {"ticket": "t"}
    assert kn["max_wait_ms"] == 7000 and kn["channel"] == "kvgate:{g}:events"
    # the knobs' text is the same on every call of a gate object (the scripts decode it once)
    assert f.eval_op("acquire", {"ticket": "u"}).argv[2] is knobs
    assert gate_flows().eval_op("bump_epoch", {}).argv[0] == ""  # no injected clock: Redis time


# -- give-backs and the breaker ----------------------------------------------------------------
def test_release_deferred_then_flushed_before_the_next_call():
    clock = Clock()
    f = gate_flows(clock)
    flow = f.release("t1", 0.5, 2)
    op = next(flow)
    assert op == Eval("release", {"ticket": "t1", "latency_ms": 500.0, "turn_index": 2})
    assert returned(flow, throw=RedisDown("lost")) is False
    assert f.deferred_count == 1 and f.breaker_open()
    clock.t += F.BREAKER_S
    flow = f.step_metrics()
    assert next(flow) == op  # the deferred release goes first
    assert flow.send({"released": 1}) == Eval("drain_stats", {"drain": 1})
    m = returned(flow, {"stats": {}, "capacity": 0})
    assert m["agentic_kv/client/deferred"] == 1 and f.deferred_count == 0


def test_a_failed_flush_keeps_the_rest_and_refuses_the_call():
    clock = Clock()
    f = gate_flows(clock)
    flow = f.release("a", 0.0, None)
    next(flow)
    returned(flow, throw=RedisDown("down"))
    assert returned(f.release("b", 0.0, None)) is False  # refused by the breaker: kept, nothing sent
    clock.t += F.BREAKER_S
    flow = f.num_preempted("s")
    assert next(flow) == Command("hget", (f.key("preempted"), "s"))  # plain commands do not flush
    assert returned(flow, b"2") == 2
    flow = f.finish_session("s")
    assert next(flow).params["ticket"] == "a"
    assert returned(flow, throw=RedisDown("down again"))["error"].startswith("Redis faulted")
    assert list(f._deferred) == ["a", "b"]  # kept, oldest first


def test_flush_at_close_is_skipped_while_the_breaker_is_open():
    f = gate_flows()
    flow = f.release("t", 0.0, None)
    next(flow)
    returned(flow, throw=RedisDown("down"))
    assert returned(f.flush_at_close()) is None and f.deferred_count == 1


# -- finish_session ---------------------------------------------------------------------------
def test_finish_session_joins_the_turns_in_flight_then_closes():
    f = gate_flows(session_lifecycle=True, close_timeout_s=2.0)
    flow = f.finish_session("s")
    assert next(flow) == Eval("finish_session", {"session": "s"})
    assert flow.send({"freed": 10, "stopped": None}) == Join("s", 2.0)
    read = flow.send((2, 1))  # two turns ended within close_timeout_s, one was still running
    assert read == Command("hget", (f.key("snapshot"), "engines"))
    engines = json.dumps([{"id": "e", "url": "http://E1:8000/"}, {"id": "x", "url": "nope"}])
    assert flow.send(engines.encode()) == Close(("http://e1:8000",), "s", 2.0)
    count = flow.send(CloseResult(1, 0))
    # counted once, in the totals (the step window reads them: lua/drain_stats.lua)
    assert isinstance(count, Pipeline) and [c.args[0] for c in count.commands] == [f.key("totals")] * 2
    out = returned(flow, [1, 1])
    assert out == {"session_id": "s", "freed": 10, "stopped": None, "joined": 2, "aborted": 1,
                   "close": {"attempts": 2, "failures": 1}}  # the malformed URL is a failed close


def test_finish_session_without_lifecycle_neither_joins_nor_closes():
    flow = gate_flows().finish_session("s")
    next(flow)
    assert returned(flow, {"freed": 0}) == {"session_id": "s", "freed": 0}


def test_finish_session_with_redis_down_still_closes():
    f = gate_flows(session_lifecycle=True)
    f.trip()
    flow = f.finish_session("s")
    assert isinstance(next(flow), Join)  # the script is refused by the breaker
    assert isinstance(flow.send((0, 0)), Command)  # the engine list is read past the breaker
    close = flow.throw(RedisDown("down"))
    assert close.urls == ()  # nowhere to send it: one failed close
    out = returned(flow, CloseResult(0, 0))  # the counters skip Redis past the breaker ...
    assert "error" in out and out["close"] == {"attempts": 1, "failures": 1}
    assert f.local["close_failure"] == 1  # ... and are counted here instead


# -- the operators' calls ---------------------------------------------------------------------
def test_operator_calls_raise_what_the_client_raised():
    f = gate_flows()
    flow = f.status()
    assert next(flow) == Eval("drain_stats", {"drain": 0})
    with pytest.raises(redis.ConnectionError):
        flow.throw(RedisDown("down", redis.ConnectionError("boom")))
    assert not f.breaker_open()  # an operator's call does not trip the turns' breaker


def test_write_snapshot_and_housekeep_and_bump_epoch():
    f = gate_flows()
    flow = f.write_snapshot([kvgate.EngineState("e", capacity_tokens=100, usage=0.5)])
    op = next(flow)
    assert op.script == "write_snapshot" and op.params["engines"][0]["id"] == "e"
    r = returned(flow, {"epoch": 2, "bumped": 1, "capacity": 100, "usage": 0.5, "n_healthy": 1})
    assert r == kvgate.SnapshotResult(2, True, 100, 0.5, 1)
    flow = f.housekeep(5)
    assert next(flow) == Eval("housekeep", {"limit": 5})
    flow = f.bump_epoch()
    next(flow)
    assert returned(flow, {"epoch": 4}) == 4
    with pytest.raises(ValueError):
        next(f.housekeep(0))


def test_bad_arguments_fail_before_any_operation():
    f = gate_flows()
    with pytest.raises(ValueError, match="'train' or 'eval'.*'train' or 'all'"):
        next(f.acquire("s", has_probe=False, scope="all", **TURN))
    with pytest.raises(ValueError, match="session_id"):
        next(f.finish_session(""))
    with pytest.raises(ValueError, match="session_id"):
        next(f.num_preempted("x" * (F.MAX_SESSION_ID + 1)))
    assert isinstance(BreakerOpen("x"), RedisDown)


def test_a_calls_argv_is_its_parameters_then_the_knobs_each_as_one_json_object():
    # the call's own parameters in ARGV[2]; the knobs' JSON, written once, in ARGV[3]
    f = GateFlows("g", kvgate.GateConfig())
    for params in ({}, {"ticket": "t", "need": 5, "prefixes": [["k", 3]]}, {"staleness_ms": 1}):
        _, raw, knobs = f.eval_op("acquire", params).argv
        assert raw == json.dumps(params, separators=(",", ":"))
        assert knobs == json.dumps(f.knobs, separators=(",", ":"))
    f.knobs = {k: v for k, v in f.knobs.items() if k != "channel"}
    assert "channel" not in json.loads(f.eval_op("release", {"ticket": "t"}).argv[2])
