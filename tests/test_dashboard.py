"""docker/grafana-dashboard.json asks Prometheus only for what kvgate exports.

The exported names are not a hand-kept list: they are the sample names kvgate's own collectors
produce, collected here from a gate on fakeredis that admitted, released and waited (so that
every family has samples) and from the registry `kvgate poller --metrics-port` serves (the
gate's collector plus the poller's own series). Every PromQL expression of the dashboard (panel
targets and template queries) may name only those metrics, and the file must have the shape
Grafana imports: panels with a type, a grid position, a Prometheus datasource and targets.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import fakeredis
import pytest
from prometheus_client import CollectorRegistry

import kvgate
from kvgate.client.metrics import GateCollector

from _gatehelpers import Clock, engines

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "docker" / "grafana-dashboard.json"

# -- what kvgate exports -------------------------------------------------------------------------


def _sample_names(registry: CollectorRegistry) -> set[str]:
    names: set[str] = set()
    for family in registry.collect():
        names.update(s.name for s in family.samples)
        if family.type in ("gauge", "unknown", "untyped"):
            names.add(family.name)  # a gauge family's name is its sample name, even with no sample
    return names


def _busy_gate() -> kvgate.Gate:
    """A gate on fakeredis with one of everything the collectors read: an admission with a
    turn index (latency by turn), a wait (FIFO), a snapshot (capacity, usage, scale)."""
    clock = Clock()
    g = kvgate.Gate(fakeredis.FakeRedis(server=fakeredis.FakeServer()), gate="dash",
                    config=kvgate.GateConfig(max_wait_s=2.0, wait_poll_s=0.2), clock_ms=clock)
    g.write_snapshot(engines(usage=0.2))
    g.acquire("s1", prompt_tokens=100, max_new_tokens=10, turn_index=0).release()
    g.write_snapshot(engines(usage=0.95))  # above the pressure guard: a newcomer waits
    with pytest.raises(kvgate.AdmissionTimeout):
        g.acquire("s2", prompt_tokens=100, max_new_tokens=10, timeout_s=0.05)
    return g


@pytest.fixture(scope="module")
def exported() -> set[str]:
    gate = _busy_gate()
    names: set[str] = set()
    reg = CollectorRegistry()
    reg.register(GateCollector(gate))
    names |= _sample_names(reg)

    # the poller's endpoint: kvgate.cli builds its registry and hands it to start_http_server;
    # catch it there instead of opening a port
    import prometheus_client

    import kvgate.cli
    import kvgate.control.poller

    served: list[CollectorRegistry] = []
    real = prometheus_client.start_http_server
    prometheus_client.start_http_server = lambda port, addr="0.0.0.0", registry=None, **kw: served.append(registry)
    try:
        poller = kvgate.control.poller.Poller(gate, engines=["http://127.0.0.1:9"])
        kvgate.cli._serve_metrics(gate, poller, "127.0.0.1", 0)
    finally:
        prometheus_client.start_http_server = real
    assert len(served) == 1
    names |= _sample_names(served[0])
    gate.close()
    return names


def test_the_collectors_export_what_the_dashboard_is_built_on(exported):
    # a sanity check of the derivation itself: if this fails, the gate was not busy enough
    for name in ("kvgate_up", "kvgate_admissions_total", "kvgate_turn_latency_seconds_mean",
                 "kvgate_budget_scale", "kvgate_poller_leader", "kvgate_poller_writes_total"):
        assert name in exported, name


def test_the_budget_scale_is_exported():
    g = kvgate.Gate(fakeredis.FakeRedis(server=fakeredis.FakeServer()), gate="bs",
                    config=kvgate.GateConfig(budget_scale=1.5), clock_ms=Clock())
    g.write_snapshot(engines(usage=0.2, cap=10_000))
    reg = CollectorRegistry()
    reg.register(GateCollector(g))
    assert reg.get_sample_value("kvgate_budget_scale", {"gate": "bs"}) == 1.5
    assert reg.get_sample_value("kvgate_ceiling_tokens", {"gate": "bs"}) == 10_000 * 0.9 * 1.5
    g.close()


# -- what the dashboard asks for -----------------------------------------------------------------

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_BRACES = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
             "offset", "bool", "atan2", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers left once strings, label
    matchers, range selectors and grouping clauses are taken out, other than functions (an
    identifier before "("), keywords, numbers and Grafana variables ($gate)."""
    e = _STRING.sub('""', expr)
    e = re.sub(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?", "0", e)  # $__rate_interval, ${var}
    e = _BRACES.sub("", e)
    e = _RANGE.sub("", e)
    e = _GROUPING.sub("", e)
    names = set()
    for m in _IDENT.finditer(e):
        word = m.group(0)
        before = e[m.start() - 1] if m.start() else " "
        after = e[m.end():].lstrip()[:1]
        if after == "(" or word.lower() in _KEYWORDS or before.isdigit() or before == ".":
            continue
        names.add(word)
    return names


def test_metric_names_of_an_expression():
    assert metric_names('max by (gate, reason) (rate(kvgate_admissions_total{gate=~"$gate"}[$__rate_interval]))') \
        == {"kvgate_admissions_total"}
    assert metric_names("a / clamp_min(b, 1e-9) * on(instance) group_left max by (instance) (c)") == {"a", "b", "c"}
    assert metric_names('sum(x{a="b c"}) or vector(0)') == {"x"}


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def _panels(dashboard: dict) -> list[dict]:
    out = []
    for p in dashboard["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # a collapsed row holds its panels
    return out


def test_the_dashboard_has_grafanas_shape(dashboard):
    assert isinstance(dashboard.get("title"), str) and dashboard["title"]
    assert isinstance(dashboard.get("uid"), str) and dashboard["uid"]
    assert isinstance(dashboard.get("schemaVersion"), int)
    panels = _panels(dashboard)
    assert panels, "no panels"
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource" and variables["DS_PROMETHEUS"]["query"] == "prometheus"
    assert "gate" in variables
    for p in panels:
        where = f"panel {p.get('id')} {p.get('title')!r}"
        assert isinstance(p.get("type"), str) and p["type"], where
        grid = p.get("gridPos")
        assert isinstance(grid, dict) and all(isinstance(grid.get(k), int) for k in ("h", "w", "x", "y")), where
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, where
        if p["type"] == "row":
            continue
        assert p.get("datasource", {}).get("type") == "prometheus", where
        assert p["datasource"].get("uid") == "${DS_PROMETHEUS}", where
        targets = p.get("targets")
        assert isinstance(targets, list) and targets, where
        refs = [t.get("refId") for t in targets]
        assert all(refs) and len(refs) == len(set(refs)), where
        for t in targets:
            assert isinstance(t.get("expr"), str) and t["expr"].strip(), where
            assert t.get("datasource", p["datasource"]) == p["datasource"], where


def _expressions(dashboard: dict) -> list[tuple[str, str]]:
    out = []
    for p in _panels(dashboard):
        for t in p.get("targets", []):
            out.append((f"panel {p['id']} {p['title']!r} {t['refId']}", t["expr"]))
    for v in dashboard["templating"]["list"]:
        if v.get("type") == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            m = re.fullmatch(r"\s*label_values\((.*),\s*([A-Za-z_][A-Za-z0-9_]*)\)\s*", q)
            assert m, f"variable {v['name']}: {q!r}"
            out.append((f"variable {v['name']}", m.group(1)))
    return out


def test_every_expression_names_only_exported_metrics(dashboard, exported):
    unknown = []
    for where, expr in _expressions(dashboard):
        names = metric_names(expr)
        assert names, f"{where}: no metric in {expr!r}"
        unknown += [f"{where}: {n}" for n in sorted(names - exported)]
    assert not unknown, "metrics kvgate does not export:\n" + "\n".join(unknown)


def test_every_expression_filters_on_the_gate_variable(dashboard):
    # HA pollers export the same gate: the panels select the gate and aggregate the pair
    for where, expr in _expressions(dashboard):
        if where.startswith("variable"):
            continue
        for selector in re.findall(r"kvgate_[A-Za-z0-9_:]*(\{[^}]*\})?", expr):
            assert 'gate=~"$gate"' in selector, f"{where}: {expr}"
