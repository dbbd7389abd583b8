"""The scripts take no default for a required parameter: one that is missing (or JSON null)
is a Lua error naming it, which the client surfaces as it surfaces any script error (a turn
degrades to a bypass, an operator's call raises it). The defaults live in kvgate/config.py."""
from __future__ import annotations

import json

import pytest
import redis

import kvgate
from kvgate.client.flows import Eval, RedisDown

from _gatehelpers import engines, mkgate, script


def raw_call(g, name: str, params: dict) -> object:
    """Call a script with exactly ``params`` (no knobs added)."""
    return g._call_script(Eval(name, params, (str(g._flows.script_clock_ms()), json.dumps(params))))


def test_a_missing_required_parameter_is_an_error_that_names_it(backend, clock):
    g = mkgate(backend, clock, gate="sp")
    g.write_snapshot(engines(usage=0.1))
    knobs = dict(g._flows.knobs)
    turn = dict(ticket="t", session="s", need=10, prompt=10, protected=0, retain=0, probe=-2)
    for drop in ("need", "staleness_ms"):
        params = {**knobs, **turn}
        params.pop(drop)
        with pytest.raises(redis.ResponseError, match=f"missing required parameter '{drop}'"):
            raw_call(g, "acquire", params)
    # a JSON null is missing too
    with pytest.raises(redis.ResponseError, match="missing required parameter 'session'"):
        raw_call(g, "acquire", {**knobs, **turn, "session": None})
    # every script names the first one it misses
    for name in kvgate.client.scripts.SCRIPT_NAMES:
        with pytest.raises(redis.ResponseError, match="missing required parameter '[a-z_]+'"):
            raw_call(g, name, {})


def test_optional_parameters_may_be_left_out(backend, clock):
    g = mkgate(backend, clock, gate="sp")
    g.write_snapshot(engines(usage=0.1))
    # no prev_prompt, gap, t0 or age; no latency_ms or turn_index; no degraded; no measured_scale
    assert script(g, "acquire", ticket="t", session="s", need=10, probe=-2)["o"] == "admit"
    assert script(g, "release", ticket="t")["released"] == 1
    assert script(g, "cancel", ticket="t")["removed"] == "none"
    assert script(g, "write_snapshot", engines=[e.to_script() for e in engines(usage=0.1)])["n_healthy"] == 1


def test_the_client_surfaces_a_missing_knob_as_it_surfaces_any_script_error(backend, clock):
    g = mkgate(backend, clock, gate="sp")
    g.write_snapshot(engines(usage=0.1))
    g._flows.knobs = {k: v for k, v in g._flows.knobs.items() if k != "staleness_ms"}
    # the turn path: a script error is a fault, so the turn fails open (SPEC 8)
    with pytest.raises(RedisDown, match="missing required parameter 'staleness_ms'"):
        g._eval(g._flows.eval_op("acquire", dict(ticket="t", session="s", need=1, prompt=1, protected=0,
                                                 retain=0, probe=-2)))
    d = g.acquire("s2", prompt_tokens=1, max_new_tokens=1)
    assert (d.outcome, d.reason) == ("bypass", "degraded")
    # an operator's call raises what Redis answered
    with pytest.raises(redis.ResponseError, match="missing required parameter 'staleness_ms'"):
        g.housekeep()


def test_the_knobs_come_apart_from_the_parameters_and_each_call_reads_the_ones_it_sent(backend, clock):
    # ARGV[3] holds the knobs (the function library keeps each text it has decoded: a new text
    # is read afresh, however many it has seen); a parameter of ARGV[2] wins over a knob
    g = mkgate(backend, clock, gate="sp")
    g.write_snapshot(engines(usage=0.1))
    clock.ms += 1000  # the snapshot is a second old now
    turn = dict(need=10, probe=-2)
    assert script(g, "acquire", ticket="t0", session="s", **turn)["o"] == "admit"
    assert script(g, "acquire", ticket="t1", session="s", staleness_ms=500, **turn)["r"] == "degraded"
    fresh = dict(g._flows.knobs)
    # more distinct knobs texts than the library keeps (lua/includes/common.lua KNOBS_MAX_SEEN)
    for i in range(70):
        stale = i % 2 == 1
        g._flows.knobs = {**fresh, "staleness_ms": 500 + i if stale else 5000 + i}
        out = script(g, "acquire", ticket=f"u{i}", session=f"s{i}", **turn)
        assert out["r"] == ("degraded" if stale else "open"), (i, out)
    g._flows.knobs = fresh
    assert script(g, "acquire", ticket="t2", session="s2", **turn)["o"] == "admit"
    # a knob left out of ARGV[3] is named when read (a turn's script error is a fault)
    g._flows.knobs = {k: v for k, v in fresh.items() if k != "headroom"}
    with pytest.raises(RedisDown, match="missing required parameter 'headroom'"):
        script(g, "acquire", ticket="t3", session="s3", **turn)
