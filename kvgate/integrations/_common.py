"""Helpers shared by the vLLM plugin and the probe clients (no vLLM import here)."""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from kvgate.client.flows import check_session_id  # noqa: F401 - the one rule for a session id, the gate's

try:  # the lead's interface (kvgate/client/probe.py)
    from kvgate.client.probe import ProbeResult
except ImportError:  # pragma: no cover - only before kvgate.client.probe exists
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class ProbeResult:  # type: ignore[no-redef]
        hit_ratio: float | None
        cached_tokens: int = 0
        total_tokens: int = 0
        cached_blocks: int = 0
        detail: str = ""

MAX_TOKEN_ID = 2**63 - 1
_INT_ONLY = {int}
PROBE_METHOD = "kvgate_probe"
USAGE_METHOD = "kvgate_usage"


def check_prompt_ids(prompt_ids: Any, what: str = "prompt_ids") -> list[int]:
    """Return `prompt_ids` as a list of ints, or raise ValueError with a clear message.

    Accepts any sequence of non-negative ints (bools are rejected: they are almost always a bug).
    """
    if type(prompt_ids) is list or type(prompt_ids) is tuple:  # fast path: plain ints (JSON, msgpack)
        if not prompt_ids:
            return []
        if set(map(type, prompt_ids)) == _INT_ONLY and min(prompt_ids) >= 0 and max(prompt_ids) <= MAX_TOKEN_ID:
            return list(prompt_ids)  # (C loops only: this runs on EngineCore's thread too)
    if isinstance(prompt_ids, (str, bytes, bytearray)) or not isinstance(prompt_ids, Sequence):
        # numpy arrays and similar are not Sequences; accept anything with tolist()
        tolist = getattr(prompt_ids, "tolist", None)
        if tolist is None or isinstance(prompt_ids, (str, bytes, bytearray)):
            raise ValueError(f"{what} must be a sequence of token ids, got {type(prompt_ids).__name__}")
        prompt_ids = tolist()
        if not isinstance(prompt_ids, list):
            raise ValueError(f"{what} must be one-dimensional")
    out = []
    for i, t in enumerate(prompt_ids):
        if isinstance(t, bool) or not isinstance(t, int):
            # numpy integer scalars are not `int` but support __index__
            index = getattr(t, "__index__", None)
            if isinstance(t, bool) or index is None:
                raise ValueError(f"{what}[{i}] must be an int token id, got {type(t).__name__}")
            t = index()
        if t < 0 or t > MAX_TOKEN_ID:
            raise ValueError(f"{what}[{i}] = {t} is not a valid token id")
        out.append(int(t))
    return out


def check_timeout(timeout_s: Any, what: str = "timeout_s") -> float:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise ValueError(f"{what} must be a number of seconds")
    t = float(timeout_s)
    if not math.isfinite(t) or t <= 0:
        raise ValueError(f"{what} must be > 0, got {timeout_s!r}")
    return t


def _int_field(payload: dict, name: str) -> int:
    v = payload.get(name)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"field {name!r} is not a non-negative int: {v!r}")
    return v


def parse_probe_payload(payload: Any, total_tokens: int | None = None) -> dict:
    """Validate one probe answer (the shared HTTP contract / the utility method's dict).

    Returns a normalised dict; raises ValueError on anything malformed or inconsistent.
    """
    if not isinstance(payload, dict):
        raise ValueError(f"probe answer is not a JSON object: {type(payload).__name__}")
    cached_tokens = _int_field(payload, "cached_tokens")
    total = _int_field(payload, "total_tokens")
    cached_blocks = _int_field(payload, "cached_blocks")
    hit = payload.get("hit_ratio")
    if isinstance(hit, bool) or not isinstance(hit, (int, float)) or not math.isfinite(hit) \
            or not 0.0 <= hit <= 1.0:
        raise ValueError(f"field 'hit_ratio' is not a number in [0, 1]: {hit!r}")
    if cached_tokens > total:
        raise ValueError(f"cached_tokens {cached_tokens} > total_tokens {total}")
    if total_tokens is not None and total != total_tokens:
        raise ValueError(f"total_tokens {total} does not match the prompt length {total_tokens}")
    engine = payload.get("engine")
    return {
        "hit_ratio": float(hit),
        "cached_tokens": cached_tokens,
        "total_tokens": total,
        "cached_blocks": cached_blocks,
        "block_size": payload.get("block_size"),
        "engine": engine if isinstance(engine, str) else None,
    }


def best_of(answers: Sequence[dict]) -> dict:
    """The answer with the most cached tokens (ties: the first)."""
    best = answers[0]
    for a in answers[1:]:
        if a["cached_tokens"] > best["cached_tokens"]:
            best = a
    return best


def to_result(answer: dict, detail: str) -> ProbeResult:
    return ProbeResult(
        hit_ratio=answer["hit_ratio"],
        cached_tokens=answer["cached_tokens"],
        total_tokens=answer["total_tokens"],
        cached_blocks=answer["cached_blocks"],
        detail=detail,
    )


def unavailable(detail: str, total_tokens: int = 0) -> ProbeResult:
    return ProbeResult(hit_ratio=None, total_tokens=total_tokens, detail=detail)
