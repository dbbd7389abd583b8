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
