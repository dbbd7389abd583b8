"""Hypothesis fuzzing of what kvgate reads from outside: the public API's arguments, engines'
``/metrics`` bodies, the router's worker lists and the probes' answers.

- A turn's arguments and a gate's knobs of any type and value: either a ``ValueError`` or
  ``TypeError`` raised before Redis is touched (the client records every call), or accepted
  values that are what the API documents (a non-empty session id of at most
  ``MAX_SESSION_ID`` characters, whole token counts >= 0 within ``MAX_TURN_TOKENS``), and a
  config the gate accepts runs its scripts.
- Accepted turns and finishes, with session ids of any characters, on a real redis-server:
  no key is written outside ``kvgate:{<gate>}:`` (SCAN after the run), and the ledger stays
  exact.
- ``promparse.parse_metrics`` on any text, and on Prometheus-shaped text with any names,
  labels and values: an ``EngineMetrics`` or ``MetricsParseError``, nothing else.
- The router's answers (``parse_workers``, ``Discovery.discover``), the engines' ``/metrics``
  answers (``scrape_engines``) and the probes' answers (``parse_probe_payload``,
  ``HttpProbe._decode``) of any status and body: their documented errors at most; and a whole
  poller tick over such answers returns its result, never an exception.

Example counts are modest (the fast suite runs these); ``deadline=None``: a slow machine is
not a failure.
"""
from __future__ import annotations

import asyncio
import json
import math

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvgate
from kvgate.client.flows import MAX_SESSION_ID, MAX_TURN_TOKENS, knob_params
from kvgate.control import promparse
from kvgate.control.discovery import Discovery, DiscoveryError, Endpoint, parse_workers
from kvgate.control.scrape import scrape_engines
from kvgate.integrations._common import parse_probe_payload
from kvgate.integrations.http_probe import HttpProbe

from _gatehelpers import engines, ledger_consistent

FEW = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
SOME = settings(max_examples=150, deadline=None)

# -- values of every kind --------------------------------------------------------------------
ANY_SCALAR = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20), st.binary(max_size=20))
ANY = st.one_of(ANY_SCALAR, st.lists(ANY_SCALAR, max_size=3), st.dictionaries(st.text(max_size=5), ANY_SCALAR,
                                                                               max_size=3))
TOKENS = st.one_of(ANY, st.integers(min_value=0, max_value=MAX_TURN_TOKENS),
                   st.integers(min_value=MAX_TURN_TOKENS - 2, max_value=MAX_TURN_TOKENS + 2))
SESSION_IDS = st.one_of(ANY, st.text(min_size=1, max_size=MAX_SESSION_ID + 8),
                        st.text(min_size=MAX_SESSION_ID - 1, max_size=MAX_SESSION_ID + 1))
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=12), c, max_size=4),
                    max_leaves=20)


class Touched(AssertionError):
    """Redis was touched by a call that should not have reached it."""


class RecordingRedis:
    """A client that records every call and answers none: anything that reaches it is a
    call the gate made to Redis."""

    def __init__(self):
        self.calls: list[str] = []

    def register_script(self, src):
        def call(*a, **kw):
            self.calls.append("script")
            raise Touched("a script was called")
        return call

    def __getattr__(self, name):
        self.calls.append(name)
        raise Touched(f"Redis was touched: {name}")


def valid_session(sid) -> bool:
    if not isinstance(sid, str) or not 0 < len(sid) <= MAX_SESSION_ID:
        return False
    try:
        sid.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def valid_count(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= MAX_TURN_TOKENS


# -- the public API ---------------------------------------------------------------------------
@SOME
@given(sid=SESSION_IDS, prompt=TOKENS, new=TOKENS, turn_index=st.one_of(st.none(), ANY),
       timeout=st.one_of(st.none(), ANY), scope=st.one_of(st.just("train"), ANY))
def test_bad_turn_arguments_are_refused_before_redis(sid, prompt, new, turn_index, timeout, scope):
    r = RecordingRedis()
    g = kvgate.Gate(r, gate="fuzz", config=kvgate.GateConfig())
    try:
        lease = g.acquire(sid, prompt_tokens=prompt, max_new_tokens=new, turn_index=turn_index,
                          timeout_s=timeout, scope=scope)
    except (ValueError, TypeError):
        assert r.calls == [], f"Redis was touched before the refusal: {r.calls}"
        return
    # accepted: only what the API documents, and then the turn fails open (Redis "down")
    assert valid_session(sid) and valid_count(prompt) and valid_count(new), (sid, prompt, new)
    assert turn_index is None or valid_count(turn_index)
    assert timeout is None or (not isinstance(timeout, bool) and math.isfinite(timeout) and timeout >= 0)
    assert scope in ("train", "eval")
    assert lease.outcome in ("bypass", "pass")


@SOME
@given(sid=SESSION_IDS)
def test_bad_session_ids_are_refused_before_redis_everywhere(sid):
    r = RecordingRedis()
    g = kvgate.Gate(r, gate="fuzz", config=kvgate.GateConfig())
    for call in (g.finish_session, g.num_preempted):
        r.calls.clear()
        try:
            call(sid)
        except (ValueError, TypeError):
            assert r.calls == []
            continue
        assert valid_session(sid)


@SOME
@given(name=st.one_of(ANY, st.text(min_size=1, max_size=140)))
def test_gate_names_are_refused_before_redis_or_keep_the_hash_tag(name):
    r = RecordingRedis()
    try:
        g = kvgate.Gate(r, gate=name, config=kvgate.GateConfig())
    except (ValueError, TypeError):
        assert r.calls == []
        return
    # one hash tag per gate: no brace, nothing that would split a key or the tag
    assert isinstance(name, str) and 0 < len(name) <= 128 and not set(name) & set("{} *?[]\n\r")
    assert g.key("ledger") == f"kvgate:{{{name}}}:ledger"


KNOBS = [f.name for f in kvgate.GateConfig.__dataclass_fields__.values()]


@SOME
@given(knobs=st.dictionaries(st.sampled_from(KNOBS), ANY, min_size=1, max_size=4))
def test_knobs_of_any_value_are_refused_or_usable(knobs):
    try:
        cfg = kvgate.GateConfig(**knobs)
    except (ValueError, TypeError):
        return
    # accepted: the knobs the scripts get are plain finite JSON, as the scripts need them
    params = knob_params(cfg, "kvgate:{fuzz}:events")
    json.dumps(params, allow_nan=False)


# -- what accepted turns write, on a real redis-server ------------------------------------------
@pytest.mark.redis_real
@FEW
@given(sids=st.lists(st.text(min_size=1, max_size=64), min_size=1, max_size=4),
       sizes=st.lists(st.integers(min_value=0, max_value=5000), min_size=2, max_size=2))
def test_accepted_turns_write_only_the_gates_keys(redis_server, sids, sizes):
    client = redis_server.client()
    client.flushall()
    g = kvgate.Gate.from_url(redis_server.url, gate="fuzz:1.a-b",
                             config=kvgate.GateConfig(staleness_s=600.0, wait_poll_s=0.2, redis_timeout_s=5.0))
    try:
        g.write_snapshot(engines(cap=1_000_000))
        leases = [g.acquire(s, prompt_tokens=sizes[0], max_new_tokens=sizes[1]) for s in sids]
        assert all(lease.outcome == "admit" for lease in leases), leases
        ledger_consistent(client, g)
        for lease in leases:
            lease.release()
        for s in sids:
            assert "error" not in g.finish_session(s)
        g.housekeep(100)
        g.step_metrics()
        assert ledger_consistent(client, g) == 0
        prefix = b"kvgate:{fuzz:1.a-b}:"
        stray = [k for k in client.scan_iter(count=1000) if not k.startswith(prefix)]
        assert stray == [], stray
    finally:
        g.close()
        client.close()


# -- engines' metrics ---------------------------------------------------------------------------
METRIC_NAMES = st.sampled_from(sorted({v for k, v in vars(promparse).items()
                                       if k[:2] in ("S_", "V_") and isinstance(v, str)})
                               + ["vllm:cache_config_info", "x", "sglang:", "vllm:"])
LABEL = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8)
VALUE = st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(repr), st.integers().map(str),
                  st.sampled_from(["NaN", "+Inf", "-Inf", "", "1e999", "0x10", "abc"]))


@st.composite
def metrics_text(draw) -> str:
    lines = []
    for _ in range(draw(st.integers(min_value=0, max_value=12))):
        name = draw(METRIC_NAMES)
        labels = draw(st.dictionaries(LABEL, st.text(max_size=6), max_size=3))
        body = ",".join(f'{k}="{json.dumps(v)[1:-1]}"' for k, v in labels.items())
        if draw(st.booleans()):
            lines.append(f"# TYPE {name} {draw(st.sampled_from(['gauge', 'counter', 'untyped', 'bogus']))}")
        lines.append(f"{name}{{{body}}} {draw(VALUE)}" if labels else f"{name} {draw(VALUE)}")
    return "\n".join(lines) + draw(st.sampled_from(["", "\n", "\n# EOF\n"]))


def parses_or_says_why(text) -> None:
    try:
        m = promparse.parse_metrics(text)
    except promparse.MetricsParseError:
        return
    assert isinstance(m, promparse.EngineMetrics)


@SOME
@given(text=st.one_of(st.text(max_size=400), metrics_text()))
def test_parse_metrics_raises_only_its_own_error(text):
    parses_or_says_why(text)


@SOME
@given(body=st.one_of(st.none(), st.binary(max_size=50), st.integers(), st.lists(st.text(max_size=5))))
def test_parse_metrics_refuses_what_is_not_text(body):
    parses_or_says_why(body)


# -- the router and the probes ----------------------------------------------------------------
WORKER = st.fixed_dictionaries({}, optional={
    "url": st.one_of(ANY, st.sampled_from(["http://10.0.0.1:30000", "http://h:1@0", "10.0.0.2:8000", "http://[::1"])),
    "id": ANY, "is_healthy": ANY, "draining": ANY, "model_id": ANY, "worker_type": ANY})
ROUTER_ANSWER = st.one_of(JSON, st.fixed_dictionaries({"workers": st.one_of(ANY, st.lists(WORKER, max_size=4))}),
                          st.fixed_dictionaries({"urls": st.one_of(ANY, st.lists(ANY, max_size=4))}))


@SOME
@given(payload=ROUTER_ANSWER, source=st.sampled_from(["workers", "list_workers"]))
def test_parse_workers_raises_only_value_error(payload, source):
    try:
        eps = parse_workers(payload, source=source)
    except ValueError:
        return
    assert all(isinstance(e, Endpoint) and e.url.startswith("http") for e in eps)


def mock_client(status: int, body: bytes, headers: dict | None = None) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(
        lambda request: httpx.Response(status, content=body, headers=headers or {})))


BODIES = st.one_of(st.binary(max_size=200), JSON.map(lambda v: json.dumps(v).encode()),
                   ROUTER_ANSWER.map(lambda v: json.dumps(v, default=repr).encode()),
                   metrics_text().map(str.encode))
STATUS = st.sampled_from([200, 200, 204, 301, 404, 500, 503])


@SOME
@given(status=STATUS, body=BODIES, length=st.one_of(st.none(), st.sampled_from(["abc", "-1", "99999999999"])))
def test_discovery_raises_only_discovery_error(status, body, length):
    async def go():
        async with mock_client(status, body, {"content-length": length} if length else None) as c:
            try:
                eps = await Discovery(router="http://router:30000", timeout_s=1.0).discover(c)
            except DiscoveryError:
                return
            assert all(isinstance(e, Endpoint) for e in eps)
    asyncio.run(go())


@SOME
@given(status=STATUS, body=BODIES)
def test_scrape_never_raises(status, body):
    async def go():
        async with mock_client(status, body) as c:
            res = await scrape_engines(c, [Endpoint("http://e1:8000"), Endpoint("http://e2:8000", healthy=False)],
                                       concurrency=2, timeout_s=1.0, max_body_bytes=1 << 16)
            assert len(res) == 2 and all((r.metrics is None) != (r.error is None) for r in res)
    asyncio.run(go())


PROBE_ANSWER = st.one_of(JSON, st.fixed_dictionaries({}, optional={
    "hit_ratio": ANY, "cached_tokens": ANY, "total_tokens": ANY, "cached_blocks": ANY, "block_size": ANY,
    "engine": ANY}))


@SOME
@given(payload=PROBE_ANSWER, n=st.one_of(st.none(), st.integers(min_value=0, max_value=100)))
def test_probe_answers_raise_only_value_error(payload, n):
    try:
        a = parse_probe_payload(payload, total_tokens=n)
    except ValueError:
        return
    assert 0.0 <= a["hit_ratio"] <= 1.0 and 0 <= a["cached_tokens"] <= a["total_tokens"]


@SOME
@given(raw=st.one_of(st.binary(max_size=200), PROBE_ANSWER.map(lambda v: json.dumps(v, default=repr).encode())))
def test_http_probe_decodes_or_raises_value_error(raw):
    try:
        HttpProbe._decode("http://e:1", raw, 10)
    except ValueError:
        pass


ENGINE_URLS = st.sampled_from(["http://e1:8000", "http://e2:8000", "http://e1:8000@1", "e3:9000", "", "http://"])
ROUTER_WORKERS = st.fixed_dictionaries({"workers": st.lists(st.fixed_dictionaries(
    {"url": ENGINE_URLS}, optional={"is_healthy": ANY, "draining": ANY}), max_size=3)})


@SOME
@given(workers=st.one_of(ROUTER_WORKERS, ROUTER_ANSWER), workers_status=STATUS,
       metrics=st.lists(st.one_of(metrics_text(), st.text(max_size=80)), min_size=1, max_size=3),
       metrics_status=STATUS)
def test_a_poller_tick_survives_any_router_and_engine_answer(workers, workers_status, metrics, metrics_status):
    # the whole tick, discovery to snapshot, over answers of any shape: a TickResult, never an
    # exception out of the poller
    import fakeredis

    from kvgate.control.poller import Poller, TickResult

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path in ("/workers", "/list_workers"):
            return httpx.Response(workers_status, content=json.dumps(workers, default=repr).encode())
        body = metrics[sum(request.url.host.encode()) % len(metrics)]  # the same engine, the same body
        return httpx.Response(metrics_status, content=body.encode("utf-8", "replace"))

    gate = kvgate.Gate(fakeredis.FakeRedis(), gate="fuzzpoll", config=kvgate.GateConfig())
    poller = Poller(gate, router="http://router:30000", interval_s=1.0, http_timeout_s=1.0)

    async def tick() -> TickResult:
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as c:
            return await poller.atick(c)
    assert isinstance(asyncio.run(tick()), TickResult)
