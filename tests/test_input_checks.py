"""Input a gate refuses before anything reaches Redis: turn arguments (sizes past what the
ledger can carry, lone surrogates, scope words, a missing ``max_new_tokens``), engine states
and snapshots the scripts cannot carry, gate names; and the largest turn allowed keeps the
ledger exact."""
from __future__ import annotations

import fakeredis
import pytest

import kvgate

from _gatehelpers import TURN, engines, ledger, mkgate


@pytest.mark.parametrize("kwargs, msg", [
    (dict(session_id="", prompt_tokens=1, max_new_tokens=1), "session_id"),
    (dict(session_id=5, prompt_tokens=1, max_new_tokens=1), "session_id"),
    (dict(session_id="s", max_new_tokens=1), "exactly one"),
    (dict(session_id="s", prompt_tokens=1, prompt_ids=[1], max_new_tokens=1), "exactly one"),
    (dict(session_id="s", prompt_ids="abc", max_new_tokens=1), "prompt_ids"),
    (dict(session_id="s", prompt_tokens=-1, max_new_tokens=1), "prompt_tokens"),
    (dict(session_id="s", prompt_tokens=1, max_new_tokens=-3), "max_new_tokens"),
    (dict(session_id="s", prompt_tokens=1, max_new_tokens=None), "max_new_tokens"),
    (dict(session_id="s", prompt_tokens=1, max_new_tokens=1, scope="test"), "scope"),
    (dict(session_id="s", prompt_tokens=1, max_new_tokens=1, turn_index=-1), "turn_index"),
    (dict(session_id="s", prompt_tokens=1, max_new_tokens=1, abort_event=True), "abort_event"),
    # NaN never ends a wait and turns every poll into a 1 ms spin; True is not a number of seconds
    (dict(session_id="s", prompt_tokens=1, max_new_tokens=1, timeout_s=float("nan")), "timeout_s"),
    (dict(session_id="s", prompt_tokens=1, max_new_tokens=1, timeout_s=float("inf")), "timeout_s"),
    (dict(session_id="s", prompt_tokens=1, max_new_tokens=1, timeout_s=True), "timeout_s"),
    (dict(session_id="s", prompt_tokens=1, max_new_tokens=1, timeout_s=-1), "timeout_s"),
])
def test_bad_turn_arguments(kwargs, msg):
    class Boom:
        def register_script(self, src):
            def call(*a, **k):
                raise AssertionError("Redis was touched")
            return call

        def __getattr__(self, name):
            raise AssertionError("Redis was touched")

    g = kvgate.Gate(Boom(), gate="g")
    sid = kwargs.pop("session_id")
    with pytest.raises(ValueError, match=msg):
        g.acquire(sid, **kwargs)


@pytest.mark.parametrize("bad", [[object()], [kvgate.EngineState("a", 1), kvgate.EngineState("a", 1)]])
def test_bad_snapshot(backend, bad):
    g = mkgate(backend)
    with pytest.raises(ValueError):
        g.write_snapshot(bad)


@pytest.mark.parametrize("kw", [dict(capacity_tokens=-1), dict(capacity_tokens=10, usage=1.5),
                                dict(capacity_tokens=0), dict(capacity_tokens=10, used_tokens=-2),
                                dict(capacity_tokens=10, hit_rate=float("nan")),
                                dict(capacity_tokens=10, prefill_s_per_token=-1e-3),
                                dict(capacity_tokens=10, prefill_s_per_token=float("inf")),
                                dict(capacity_tokens=10, prefill_s_per_token="1"),
                                dict(capacity_tokens=10, prefill_load=-0.5),
                                dict(capacity_tokens=10, prefill_load=float("nan"))])
def test_bad_engine_state(kw):
    with pytest.raises(ValueError):
        kvgate.EngineState("e", **kw)


def test_bad_gate_name():
    with pytest.raises(ValueError, match="gate name"):
        kvgate.Gate(None, gate="a b{c}")


@pytest.mark.parametrize("kw", [
    dict(prompt_tokens=2**31, max_new_tokens=1),
    dict(prompt_tokens=1, max_new_tokens=2**31),
    dict(prompt_tokens=1, max_new_tokens=2**63 - 1),
])
def test_sizes_past_what_the_ledger_can_hold_are_refused(kw):
    g = kvgate.Gate(fakeredis.FakeRedis(), gate="g")
    g.write_snapshot(engines())
    with pytest.raises(ValueError, match="more than a turn may claim"):
        g.acquire("s", **kw)
    assert g.redis.hget(g.key("ledger"), "reserved") is None
    assert g.redis.hlen(g.key("leases")) == 0


def test_largest_turn_keeps_the_ledger_exact(clock):
    # at the bound, the charge and the refund are exact integers in the scripts
    g = kvgate.Gate(fakeredis.FakeRedis(), gate="g", clock_ms=clock,
                    config=kvgate.GateConfig(admission=False))
    g.write_snapshot(engines(usage=0.9))
    cap = 2**31 - 1
    first = g.acquire("s", prompt_tokens=10, max_new_tokens=0, protected=False)
    first.release()
    lease = g.acquire("s", prompt_tokens=cap, max_new_tokens=cap)
    assert lease.reason == "reserved_session" and ledger(g) == 2 * cap
    lease.release()
    g.finish_session("s")
    assert ledger(g) == 0


def test_lone_surrogate_session_id_is_refused():
    g = kvgate.Gate(fakeredis.FakeRedis(), gate="g")
    for call in (lambda: g.acquire("\ud800", prompt_tokens=1, max_new_tokens=1),
                 lambda: g.finish_session("a\udcff"), lambda: g.num_preempted("\ud800")):
        with pytest.raises(ValueError, match="lone surrogate"):
            call()
    assert g.redis.keys("*") == []


@pytest.mark.parametrize("kw, match", [
    (dict(capacity_tokens=2**36 + 1), "capacity_tokens"),
    (dict(capacity_tokens=100, used_tokens=2**36 + 1), "used_tokens"),
    (dict(capacity_tokens=100, used_tokens=True), "used_tokens"),
    (dict(capacity_tokens=100, url="10.0.0.5:30000"), "url of e0"),
    (dict(capacity_tokens=100, url="http://h:1/?q=1"), "url of e0"),
])
def test_engine_state_refuses_what_the_scripts_cannot_carry(kw, match):
    with pytest.raises(ValueError, match=match):
        kvgate.EngineState("e0", **kw)


def test_max_new_tokens_is_required(driver):
    g = driver.gate()
    with pytest.raises(TypeError, match="max_new_tokens"):
        g.acquire("s", prompt_tokens=10)
    driver.close(g)


def test_scope_words_and_their_errors(driver):
    g = driver.gate()  # gates train turns only
    driver(g.write_snapshot(engines()))
    assert driver(g.acquire("s", scope="eval", **TURN)).outcome == "pass"
    with pytest.raises(ValueError, match=r"'train' or 'eval'.*config scope, 'train' or 'all'"):
        driver(g.acquire("s", scope="all", **TURN))
    with pytest.raises(ValueError, match="'train' or 'all'"):
        kvgate.GateConfig(scope="eval")
    everything = driver.gate(scope="all")
    lease = driver(everything.acquire("s", scope="eval", **TURN))
    assert lease.outcome == "admit"
    driver(lease.release())
    driver.close(g)