"""GateConfig: defaults from the seeds, validation of every knob (only when its feature is
on), KVGATE_* environment overrides with clear errors."""
from __future__ import annotations

import math

import pytest

from kvgate import GateConfig


def test_defaults_from_the_seeds():
    c = GateConfig()
    assert (c.admission, c.residency, c.session_lifecycle) == (True, True, False)
    assert (c.headroom, c.pressure_threshold, c.high_watermark, c.hit_threshold) == (0.90, 0.92, 0.85, 0.80)
    assert c.expected_decode_cap is None
    assert (c.max_wait_s, c.wait_poll_s, c.idle_grace_s, c.lease_ttl_s, c.staleness_s) == (30.0, 5.0, 60.0, 600.0, 6.0)
    assert c.max_wait_hard_s == 1800.0  # SPEC 6: the backstop NVIDIA Dynamo's session-aware admission uses
    assert c.scope == "train"
    assert c.budget_scale is None  # measured by the poller (docs/budget.md)


BAD = [
    ("headroom", 0.0), ("headroom", 1.01), ("headroom", -1), ("headroom", "0.5"), ("headroom", math.nan),
    ("pressure_threshold", 0.0), ("pressure_threshold", 1.5),
    ("high_watermark", 0.0), ("high_watermark", 1.2), ("high_watermark", 0.95),  # > pressure_threshold
    ("hit_threshold", -0.1), ("hit_threshold", 1.1),
    ("expected_decode_cap", 0), ("expected_decode_cap", -5), ("expected_decode_cap", 1.5), ("expected_decode_cap", True),
    ("max_wait_s", -1), ("max_wait_s", math.inf), ("wait_poll_s", 0), ("idle_grace_s", -0.1),
    ("max_wait_hard_s", -1), ("max_wait_hard_s", math.nan), ("max_wait_hard_s", 10.0),  # < max_wait_s
    ("max_wait_s", 3600.0),  # > max_wait_hard_s
    ("budget_scale", 0), ("budget_scale", -1.0), ("budget_scale", math.inf), ("budget_scale", math.nan),
    ("budget_scale", "2"), ("budget_scale", True),
    ("lease_ttl_s", 0), ("staleness_s", 0), ("scope", "eval"), ("scope", ""),
    ("admission", 1), ("residency", "yes"), ("session_lifecycle", None),
    ("redis_timeout_s", 0), ("probe_timeout_s", -1), ("close_timeout_s", 0), ("reap_batch", 0),
    ("engine_urls", ["http://a"]), ("engine_urls", ("",)),
    # past ~2**63 ms the scripts' integer milliseconds wrap negative: a lease that expires at once
    ("lease_ttl_s", 1e16), ("idle_grace_s", 1e16), ("max_wait_hard_s", 1e10), ("wait_poll_s", 2e9),
]


@pytest.mark.parametrize("knob, value", BAD)
def test_every_knob_rejects_bad_values(knob, value):
    with pytest.raises(ValueError, match=knob):
        GateConfig(**{knob: value})


@pytest.mark.parametrize("knob, value, feature", [
    ("headroom", 0.0, "admission"), ("pressure_threshold", 2.0, "admission"),
    ("expected_decode_cap", 0, "admission"),
    ("high_watermark", 0.0, "residency"), ("hit_threshold", 5.0, "residency"),
])
def test_feature_knobs_validated_only_when_feature_on(knob, value, feature):
    c = GateConfig(**{knob: value, feature: False})  # accepted: the feature is off
    assert getattr(c, knob) == value and getattr(c, feature) is False  # kept as given, not clamped
    with pytest.raises(ValueError, match=knob):
        GateConfig(**{knob: value})


def test_watermark_above_pressure_allowed_without_admission():
    c = GateConfig(admission=False, high_watermark=0.95)
    assert (c.admission, c.residency, c.high_watermark, c.pressure_threshold) == (False, True, 0.95, 0.92)
    assert c.gating  # residency alone still gates


def test_boundaries_accepted():
    c = GateConfig(headroom=1.0, pressure_threshold=1.0, high_watermark=1.0, hit_threshold=0.0,
                   max_wait_s=0.0, idle_grace_s=0.0)
    assert (c.headroom, c.pressure_threshold, c.high_watermark, c.hit_threshold) == (1.0, 1.0, 1.0, 0.0)
    assert (c.max_wait_s, c.idle_grace_s) == (0.0, 0.0)
    # the rest keep their defaults
    assert (c.wait_poll_s, c.lease_ttl_s, c.staleness_s, c.scope) == (5.0, 600.0, 6.0, "train")


def test_env_overrides():
    env = {"KVGATE_MAX_WAIT_S": "10", "KVGATE_RESIDENCY": "off", "KVGATE_EXPECTED_DECODE_CAP": "512",
           "KVGATE_SCOPE": "all", "KVGATE_ENGINE_URLS": "http://a:1, http://b:2", "OTHER": "x"}
    c = GateConfig.from_env(env)
    assert (c.max_wait_s, c.residency, c.expected_decode_cap, c.scope) == (10.0, False, 512, "all")
    assert c.engine_urls == ("http://a:1", "http://b:2")
    assert GateConfig.from_env(env, max_wait_s=3.0).max_wait_s == 3.0  # explicit beats env
    assert GateConfig.from_env({"KVGATE_EXPECTED_DECODE_CAP": "none"}).expected_decode_cap is None
    assert GateConfig.from_env({"KVGATE_MAX_WAIT_HARD_S": "600"}).max_wait_hard_s == 600.0
    assert GateConfig.from_env({"KVGATE_BUDGET_SCALE": "1.5"}).budget_scale == 1.5
    assert GateConfig.from_env({"KVGATE_BUDGET_SCALE": "auto"}).budget_scale is None


@pytest.mark.parametrize("make", ["init", "from_url"])
def test_a_client_without_config_reads_the_environment(make, monkeypatch):
    import fakeredis

    import kvgate
    monkeypatch.setenv("KVGATE_MAX_WAIT_S", "7")
    monkeypatch.setenv("KVGATE_MAX_WAIT_HARD_S", "70")
    for cls in (kvgate.Gate, kvgate.AsyncGate):
        if make == "init":
            r = fakeredis.FakeRedis() if cls is kvgate.Gate else fakeredis.FakeAsyncRedis()
            g = cls(r, gate="g")
        else:
            g = cls.from_url("redis://127.0.0.1:1/0", gate="g")
        assert (g.config.max_wait_s, g.config.max_wait_hard_s) == (7.0, 70.0)
        # an explicit config is taken as given, the environment aside
        g2 = cls(fakeredis.FakeRedis() if cls is kvgate.Gate else fakeredis.FakeAsyncRedis(), gate="g",
                 config=GateConfig())
        assert g2.config.max_wait_s == 30.0
    monkeypatch.setenv("KVGATE_MAX_WAIT_S", "soon")
    with pytest.raises(ValueError, match="KVGATE_MAX_WAIT_S"):
        kvgate.Gate(fakeredis.FakeRedis(), gate="g")


@pytest.mark.parametrize("var, raw", [("KVGATE_MAX_WAIT_S", "soon"), ("KVGATE_ADMISSION", "maybe"),
                                      ("KVGATE_REAP_BATCH", "1.5"), ("KVGATE_HEADROOM", "2")])
def test_env_errors_name_the_variable(var, raw):
    with pytest.raises(ValueError, match=var.replace("KVGATE_", "").lower() if raw == "2" else var):
        GateConfig.from_env({var: raw})


def test_the_longest_times_are_still_accepted():
    c = GateConfig(lease_ttl_s=1e9, idle_grace_s=1e9, max_wait_s=1e9, max_wait_hard_s=1e9)
    assert (c.lease_ttl_s, c.idle_grace_s, c.max_wait_s, c.max_wait_hard_s) == (1e9, 1e9, 1e9, 1e9)


def test_config_refuses_malformed_engine_urls_and_huge_decode_cap():
    with pytest.raises(ValueError, match="scheme"):
        GateConfig(engine_urls=("engine:30000",))
    with pytest.raises(ValueError, match="expected_decode_cap"):
        GateConfig(expected_decode_cap=2**31)
    GateConfig(engine_urls=("http://engine:30000/",), expected_decode_cap=2**31 - 1)


# -- knobs of a feature that is off: not validated (SPEC 6), so never used as given --------
# An out-of-range value of a feature that is off is kept in the config as given (the test
# above), and the gate uses the knob's default instead: the ceiling in step metrics and
# status, the reservation of a turn, the knobs the scripts read.
OFF_KNOBS = [
    ("headroom", math.nan, "admission"), ("headroom", math.inf, "admission"), ("headroom", -3.0, "admission"),
    ("pressure_threshold", math.nan, "admission"), ("high_watermark", math.nan, "residency"),
    ("hit_threshold", math.inf, "residency"),
]


@pytest.mark.parametrize("knob, value, feature", OFF_KNOBS)
def test_an_unchecked_knob_of_a_feature_that_is_off_is_not_used(knob, value, feature):
    from kvgate.client.flows import knob_params
    c = GateConfig(**{knob: value, feature: False})
    assert c.effective(knob) == getattr(GateConfig(), knob)  # the default, not the raw value
    sent = knob_params(c, "ch")
    assert sent[knob] == getattr(GateConfig(), knob)  # the scripts' parameter is named as the knob
    # a value that passes the check is used even with its feature off
    ok = GateConfig(**{knob: 1.0, feature: False})
    assert ok.effective(knob) == 1.0 and knob_params(ok, "ch")[knob] == 1.0


def _sync_and_async_gates(cfg):
    import fakeredis

    import kvgate
    server = fakeredis.FakeServer()
    return (kvgate.Gate(fakeredis.FakeRedis(server=server), gate="g", config=cfg),
            kvgate.AsyncGate(fakeredis.FakeAsyncRedis(server=server), gate="g", config=cfg))


@pytest.mark.parametrize("headroom", [math.nan, math.inf, -math.inf, 7.0])
def test_admission_off_with_a_bad_headroom_keeps_metrics_and_status_working(headroom):
    import asyncio

    import kvgate
    cfg = GateConfig(admission=False, headroom=headroom)
    g, ag = _sync_and_async_gates(cfg)
    g.write_snapshot([kvgate.EngineState("e1", capacity_tokens=10_000, usage=0.1, url="http://127.0.0.1:9")])
    with g.turn("s", prompt_tokens=100, max_new_tokens=10):
        m = g.step_metrics(drain=False)
        st = g.status()
    assert m["agentic_kv/budget/ceiling"] == 9000.0 and st["ceiling"] == 9000  # the default headroom
    assert math.isfinite(m["agentic_kv/budget/reserved_utilization"])

    async def run():
        try:
            async with ag.turn("s2", prompt_tokens=100, max_new_tokens=10):
                return await ag.step_metrics(), await ag.status()
        finally:
            await ag.aclose()
    am, ast = asyncio.run(run())
    assert am["agentic_kv/budget/ceiling"] == 9000.0 and ast["ceiling"] == 9000
    g.close()


@pytest.mark.parametrize("cap", [-1000, 0, True, 2**40])
def test_admission_off_with_a_bad_decode_cap_never_charges_less_than_the_prompt(cap):
    import asyncio

    import kvgate
    from kvgate.client.flows import build_request
    cfg = GateConfig(admission=False, expected_decode_cap=cap)
    assert build_request(cfg, "s", prompt_tokens=100, max_new_tokens=50).need == 150  # no cap, as by default
    g, ag = _sync_and_async_gates(cfg)
    g.write_snapshot([kvgate.EngineState("e1", capacity_tokens=10_000, usage=0.1, url="http://127.0.0.1:9")])
    with g.turn("s", prompt_tokens=100, max_new_tokens=50) as lease:
        assert lease.tokens == 150
    # the turn gave back what it took: nothing left, and no give-back clamped at zero
    assert int(g.redis.hget(g.key("ledger"), "reserved") or 0) == 0
    assert g.redis.hget(g.key("totals"), "ledger_clamped") is None

    async def run():
        try:
            async with ag.turn("s2", prompt_tokens=100, max_new_tokens=50) as lease:
                return lease.tokens
        finally:
            await ag.aclose()
    assert asyncio.run(run()) == 150
    # a valid cap still applies with admission off (the windows' charge)
    assert build_request(GateConfig(admission=False, expected_decode_cap=8), "s", prompt_tokens=100,
                         max_new_tokens=50).need == 108
    g.close()
