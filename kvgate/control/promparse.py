"""Parse an engine's Prometheus ``/metrics`` text into the few KV numbers kvgate needs.

Pure functions, no I/O.  Parsing uses ``prometheus_client.parser.text_string_to_metric_families``;
anything it cannot read (HTML error pages, JSON, truncated bodies) becomes a
:class:`MetricsParseError` (a ``ValueError``), never another exception.

Decisions (see docs/poller.md, "Metrics parsing"):

* Samples are indexed by their *sample* name, not the family name: the prometheus_client
  parser strips ``_total`` from counter family names (``vllm:prefix_cache_hits``) but keeps it
  on the samples (``vllm:prefix_cache_hits_total``), and untyped text keeps it everywhere.
* Series of one engine that differ only by tensor/pipeline/expert-parallel rank
  (``tp_rank``, ``pp_rank``, ``moe_ep_rank``, or any other label) repeat the same per-engine
  value: they are aggregated by **max**, never summed.
* Data parallelism: every DP rank has its own KV pool and scheduler, so each one becomes its
  own :class:`RankMetrics` (SGLang ``dp_rank`` label, vLLM ``engine`` label).  The poller turns
  each into its own ``EngineState`` (engine id ``<url>#dp<rank>``) sharing the base URL.  The
  ledger ceiling (a sum over engines) and the worst usage (a max over engines) then come out
  right without special cases.
* vLLM capacity = ``num_gpu_blocks`` x ``block_size`` from the labels of
  ``vllm:cache_config_info``; vLLM has no used-token gauge, so ``used_tokens`` is
  ``round(kv_cache_usage_perc x capacity)``.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from prometheus_client.parser import text_string_to_metric_families

__all__ = [
    "MetricsParseError",
    "RankMetrics",
    "EngineMetrics",
    "parse_metrics",
    "SGLANG",
    "VLLM",
]

SGLANG = "sglang"
VLLM = "vllm"

# Labels that split one engine into data-parallel engines, per engine kind.
_DP_LABELS = {SGLANG: "dp_rank", VLLM: "engine"}

# SGLang gauge / counter sample names.
S_CAPACITY = "sglang:max_total_num_tokens"
S_USED = "sglang:num_used_tokens"
S_USAGE = "sglang:token_usage"
S_RUNNING = "sglang:num_running_reqs"
S_QUEUED = "sglang:num_queue_reqs"
S_HIT_RATE = "sglang:cache_hit_rate"
S_RETRACTED_TOTAL = "sglang:num_retracted_requests_total"  # counter (newer builds)
S_RETRACTED_GAUGE = "sglang:num_retracted_reqs"  # gauge (older builds, per interval)
S_PROMPT_TOKENS = "sglang:prompt_tokens_total"  # prompt tokens looked up (the prefix-cache queries)
S_CACHED_TOKENS = "sglang:cached_tokens_total"  # of those, found in the radix cache (the hits)
S_AVAILABLE = "sglang:kv_available_tokens"
S_EVICTABLE = "sglang:kv_evictable_tokens"
# seconds requests waited in the engine's queue before they were scheduled (histogram sums,
# observed once per request); both engines export it
S_QUEUE_S = "sglang:queue_time_seconds_sum"

# vLLM sample names.
V_CACHE_INFO = "vllm:cache_config_info"
V_USAGE = "vllm:kv_cache_usage_perc"
V_USAGE_OLD = "vllm:gpu_cache_usage_perc"  # v0 / early v1 name
V_RUNNING = "vllm:num_requests_running"
V_QUEUED = "vllm:num_requests_waiting"
V_HITS = "vllm:prefix_cache_hits_total"
V_QUERIES = "vllm:prefix_cache_queries_total"
V_PREEMPTIONS = "vllm:num_preemptions_total"
V_QUEUE_S = "vllm:request_queue_time_seconds_sum"
# both observed once per finished request: prefill seconds, and the prompt tokens it computed
# (cached tokens excluded); their sums give seconds per uncached token
V_PREFILL_S = "vllm:request_prefill_time_seconds_sum"
V_PREFILL_TOKENS = "vllm:request_prefill_kv_computed_tokens_sum"
# SGLang exports no prefill time; the simulator can (opt-in, docs/simulator.md), under its own
# names, so the prefill-cost rules can run on its GPU profile. Read for SGLang-kind bodies only.
SIM_PREFILL_S = "kvgate_sim:prefill_seconds_total"
SIM_PREFILL_TOKENS = "kvgate_sim:prefill_computed_tokens_total"


# every sample name parse_metrics reads: bodies are cut down to these before parsing
_WANTED = frozenset({S_CAPACITY, S_USED, S_USAGE, S_RUNNING, S_QUEUED, S_HIT_RATE, S_RETRACTED_TOTAL,
                     S_RETRACTED_GAUGE, S_AVAILABLE, S_EVICTABLE, S_PROMPT_TOKENS, S_CACHED_TOKENS,
                     V_CACHE_INFO, V_USAGE, V_USAGE_OLD,
                     V_RUNNING, V_QUEUED, V_HITS, V_QUERIES, V_PREEMPTIONS, V_PREFILL_S,
                     V_PREFILL_TOKENS, SIM_PREFILL_S, SIM_PREFILL_TOKENS, S_QUEUE_S, V_QUEUE_S})


# where a sample line's metric name ends: its labels, or the blank before its value
_NAME_END = re.compile(r"[{\s]")


def _wanted_lines(text: str) -> str:
    """The lines of a Prometheus body that carry (or describe) a sample parse_metrics reads.

    An engine's /metrics is mostly histograms the poller never looks at (a vLLM body runs to
    hundreds of bucket lines); the text parser is pure Python, so the poller parses only
    what it uses."""
    return select_lines(text, _WANTED)


def select_lines(text: str, names: frozenset[str] | set[str]) -> str:
    """The sample lines of ``text`` whose name is in ``names``, with the ``# HELP`` / ``# TYPE``
    lines of their families (a counter's family may be named without ``_total``). As in the
    text format (and prometheus_client's parser), blanks before a line are ignored, and a
    sample line's name ends at ``{`` or at the first blank (space or tab)."""
    families = set(names) | {n[:-len("_total")] for n in names if n.endswith("_total")}
    keep = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE") and parts[2] in families:
                keep.append(line)
            continue
        m = _NAME_END.search(line)
        end = m.start() if m else -1
        if end > 0 and line[:end] in names:
            keep.append(line)
    return "\n".join(keep) + "\n" if keep else ""


class MetricsParseError(ValueError):
    """The text is not Prometheus text, or lacks the KV metrics kvgate needs."""


@dataclass(frozen=True)
class RankMetrics:
    """The KV numbers of one engine (one data-parallel rank), TP/PP ranks folded by max."""

    kind: str
    dp_rank: str | None
    capacity_tokens: int
    used_tokens: int | None = None
    usage: float | None = None
    running_requests: int | None = None
    queued_requests: int | None = None
    hit_rate: float | None = None
    prefix_cache_hits: float | None = None
    prefix_cache_queries: float | None = None
    preemptions: float | None = None
    available_tokens: int | None = None
    evictable_tokens: int | None = None
    prefill_seconds: float | None = None  # cumulative (vLLM histogram sums)
    prefill_tokens: float | None = None
    queue_seconds: float | None = None  # cumulative (histogram sums)
    series: int = 1  # how many rank series were folded into this record

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(frozen=True)
class EngineMetrics:
    """Everything parsed from one ``/metrics`` body: its kind and one record per DP rank."""

    kind: str
    ranks: tuple[RankMetrics, ...]
    model_names: tuple[str, ...] = field(default=())

    @property
    def data_parallel(self) -> bool:
        return len(self.ranks) > 1 or any(r.dp_rank is not None for r in self.ranks)


# ---------------------------------------------------------------------------------------------


def _finite(v) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _check_text(text: str) -> None:
    if not isinstance(text, str):
        raise MetricsParseError(f"metrics body must be str, got {type(text).__name__}")
    head = text.lstrip()[:64].lower()
    if head.startswith("<") or head.startswith("{") or head.startswith("["):
        # HTML error pages and JSON bodies: say so instead of a parser message about a name.
        raise MetricsParseError(f"not Prometheus text (starts with {text.lstrip()[:20]!r})")


def _read_samples(text: str) -> list[tuple[str, dict, float | None]]:
    _check_text(text)
    out: list[tuple[str, dict, float | None]] = []
    try:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out.append((s.name, dict(s.labels), _finite(s.value)))
    except MetricsParseError:
        raise
    except Exception as e:  # the parser raises ValueError, IndexError, KeyError, ... on junk
        raise MetricsParseError(f"unparsable Prometheus text: {type(e).__name__}: {e}"[:300]) from None
    return out


def _detect_kind(names: Iterable[str]) -> str:
    has_s = has_v = False
    for n in names:
        if n == S_CAPACITY:
            return SGLANG
        if n == V_CACHE_INFO:
            has_v = True
        elif n.startswith("sglang:"):
            has_s = True
        elif n.startswith("vllm:"):
            has_v = True
    if has_v:
        return VLLM
    if has_s:
        return SGLANG
    raise MetricsParseError("no sglang: or vllm: metrics in the body")


class _Group:
    """Max-folding accumulator for one DP rank."""

    def __init__(self) -> None:
        self.vals: dict[str, float] = {}
        self.series: dict[str, int] = {}
        self.capacity_info: int | None = None  # vLLM cache_config_info

    def put(self, name: str, value: float | None) -> None:
        if value is None:
            return
        self.series[name] = self.series.get(name, 0) + 1
        old = self.vals.get(name)
        if old is None or value > old:
            self.vals[name] = value

    def get(self, name: str) -> float | None:
        return self.vals.get(name)


def _int_or_none(v: float | None) -> int | None:
    """Token / request counts: rounded, and a negative count is a broken exporter -> missing."""
    if v is None or v < 0:
        return None
    return int(round(v))


def _vllm_capacity(labels: Mapping[str, str]) -> int | None:
    """``num_gpu_blocks x block_size``; newer builds also label ``kv_cache_size_tokens``,
    used only when the block labels are unusable."""
    try:
        blocks = int(float(labels.get("num_gpu_blocks", "")))
        size = int(float(labels.get("block_size", "")))
        if blocks > 0 and size > 0:
            return blocks * size
    except (TypeError, ValueError, OverflowError):
        pass  # "None" before the engine profiled memory; "inf" from a broken exporter
    try:
        tokens = int(float(labels.get("kv_cache_size_tokens", "")))
    except (TypeError, ValueError, OverflowError):
        return None
    return tokens if tokens > 0 else None


def parse_metrics(text: str) -> EngineMetrics:
    """Parse one engine's ``/metrics`` body; raise :class:`MetricsParseError` when unusable.

    Usable means: Prometheus text with a known engine kind and a positive KV capacity for
    every data-parallel rank it reports. Only the lines of the samples it reads are parsed;
    a body that is unusable that way is parsed whole, so errors name what is wrong with it.
    """
    _check_text(text)
    short = _wanted_lines(text)
    if short:
        try:
            return _parse_samples(_read_samples(short))
        except MetricsParseError:
            pass
    return _parse_samples(_read_samples(text))


def _parse_samples(samples: list[tuple[str, dict, float | None]]) -> EngineMetrics:
    if not samples:
        raise MetricsParseError("empty metrics body")
    kind = _detect_kind(n for n, _, _ in samples)
    dp_label = _DP_LABELS[kind]
    prefix = f"{kind}:"
    groups: dict[str | None, _Group] = {}
    models: set[str] = set()
    for name, labels, value in samples:
        if not name.startswith(prefix) and name not in (SIM_PREFILL_S, SIM_PREFILL_TOKENS):
            continue
        dp = labels.get(dp_label)
        if dp == "":
            dp = None
        g = groups.setdefault(dp, _Group())
        if "model_name" in labels:
            models.add(labels["model_name"])
        if name == V_CACHE_INFO:
            cap = _vllm_capacity(labels)
            if cap is not None and (g.capacity_info is None or cap > g.capacity_info):
                g.capacity_info = cap
            continue
        g.put(name, value)

    # vLLM prints cache_config_info with engine="" in some builds and per engine in others: an
    # engine without its own info row borrows the only one there is.
    if kind == VLLM:
        infos = {g.capacity_info for g in groups.values() if g.capacity_info is not None}
        if len(infos) == 1:
            only = infos.pop()
            for g in groups.values():
                if g.capacity_info is None:
                    g.capacity_info = only

    # Series without a DP label next to DP-labelled ones are server-wide (SGLang's tokenizer
    # counters, vLLM's engine="" info row), not an engine of their own.
    if None in groups and len(groups) > 1 and not _has_engine_values(groups[None], kind):
        del groups[None]

    ranks: list[RankMetrics] = []
    for dp in sorted(groups, key=lambda d: (d is not None, _rank_sort_key(d))):
        g = groups[dp]
        rm = _build_rank(kind, dp, g)
        ranks.append(rm)
    if not ranks:
        raise MetricsParseError(f"no {kind}: samples with values")
    return EngineMetrics(kind=kind, ranks=tuple(ranks), model_names=tuple(sorted(models)))


def _has_engine_values(g: _Group, kind: str) -> bool:
    keys = (S_CAPACITY, S_USAGE, S_USED) if kind == SGLANG else (V_USAGE, V_USAGE_OLD, V_RUNNING)
    return any(g.get(k) is not None for k in keys)


def _rank_sort_key(d: str | None):
    if d is None:
        return (0, 0, "")
    try:
        return (0, int(d), "")
    except ValueError:
        return (1, 0, d)


def _build_rank(kind: str, dp: str | None, g: _Group) -> RankMetrics:
    where = f"{kind} engine" + (f" dp rank {dp}" if dp is not None else "")
    if kind == SGLANG:
        cap = _int_or_none(g.get(S_CAPACITY))
        if cap is None or cap <= 0:
            raise MetricsParseError(f"{where}: no positive {S_CAPACITY}")
        used = _int_or_none(g.get(S_USED))
        usage = g.get(S_USAGE)
        if usage is None and used is not None:
            usage = used / cap
        preempt = g.get(S_RETRACTED_TOTAL)
        if preempt is None:
            preempt = g.get(S_RETRACTED_GAUGE)
        # SGLang exports no prefill time (its time to first token counts the queue: several
        # times the prefill on a busy engine); the simulator can, under its own names
        prefill_s, prefill_tok = g.get(SIM_PREFILL_S), g.get(SIM_PREFILL_TOKENS)
        prompt, cached = g.get(S_PROMPT_TOKENS), g.get(S_CACHED_TOKENS)
        return RankMetrics(
            kind=kind,
            dp_rank=dp,
            capacity_tokens=cap,
            used_tokens=used,
            usage=_clamp01(usage),
            running_requests=_int_or_none(g.get(S_RUNNING)),
            queued_requests=_int_or_none(g.get(S_QUEUED)),
            hit_rate=_clamp01(g.get(S_HIT_RATE)),
            prefix_cache_hits=cached,
            prefix_cache_queries=prompt,
            preemptions=preempt,
            available_tokens=_int_or_none(g.get(S_AVAILABLE)),
            evictable_tokens=_int_or_none(g.get(S_EVICTABLE)),
            prefill_seconds=prefill_s,
            prefill_tokens=prefill_tok,
            queue_seconds=g.get(S_QUEUE_S),
            series=max(g.series.get(S_CAPACITY, 1), 1),
        )
    cap = g.capacity_info
    if cap is None:
        raise MetricsParseError(
            f"{where}: no usable {V_CACHE_INFO} (needs num_gpu_blocks and block_size labels)")
    usage = g.get(V_USAGE)
    if usage is None:
        usage = g.get(V_USAGE_OLD)
    usage = _clamp01(usage)
    hits, queries = g.get(V_HITS), g.get(V_QUERIES)
    hit_rate = None
    if hits is not None and queries is not None and queries > 0:
        hit_rate = _clamp01(hits / queries)
    return RankMetrics(
        kind=kind,
        dp_rank=dp,
        capacity_tokens=cap,
        used_tokens=None if usage is None else int(round(usage * cap)),
        usage=usage,
        running_requests=_int_or_none(g.get(V_RUNNING)),
        queued_requests=_int_or_none(g.get(V_QUEUED)),
        hit_rate=hit_rate,
        prefix_cache_hits=hits,
        prefix_cache_queries=queries,
        preemptions=g.get(V_PREEMPTIONS),
        prefill_seconds=g.get(V_PREFILL_S),
        prefill_tokens=g.get(V_PREFILL_TOKENS),
        queue_seconds=g.get(V_QUEUE_S),
        series=max(g.series.get(V_USAGE, 1), 1),
    )


def _clamp01(v: float | None) -> float | None:
    if v is None:
        return None
    return min(max(v, 0.0), 1.0)
