"""GateConfig: every knob of SPEC section 6, validated, with ``KVGATE_*`` overrides."""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from ._urls import normalize_base_url

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


# the longest time a knob in seconds may hold (~31 years): milliseconds stay exact integers
MAX_SECONDS = 1e9


@dataclass(frozen=True)
class GateConfig:
    """The gate's knobs. Defaults come from the two seed documents.

    Numeric knobs are validated only when the feature they belong to is on
    (``admission``, ``residency``), as in seed 003 and SPEC section 6; the wait, lease and
    snapshot knobs apply to every gated turn and are always validated. A knob of a feature
    that is off keeps the value it was given, but the gate never uses a value that would
    fail the check (NaN, a negative decode cap, ...): ``effective(name)`` is what the gate
    uses, the knob's default in that case (some of these knobs still matter with their
    feature off: the ceiling in metrics and status, the decode cap in window charges).
    """

    admission: bool = True
    residency: bool = True
    session_lifecycle: bool = False
    headroom: float = 0.90
    pressure_threshold: float = 0.92
    high_watermark: float = 0.85
    hit_threshold: float = 0.80
    expected_decode_cap: int | None = None
    max_wait_s: float = 30.0
    max_wait_hard_s: float = 1800.0
    wait_poll_s: float = 5.0
    idle_grace_s: float = 60.0
    lease_ttl_s: float = 600.0
    staleness_s: float = 6.0
    scope: str = "train"
    # expert overrides and operational knobs (not in the seeds; docs/knobs.md#expert-overrides)
    # a fixed budget scale instead of the measured one (None: the poller's controller sizes it)
    budget_scale: float | None = None
    redis_timeout_s: float = 1.0
    probe_timeout_s: float = 0.5
    close_timeout_s: float = 2.0
    reap_batch: int = 8
    engine_urls: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        self.validate()

    # -- validation ---------------------------------------------------------------------
    def validate(self) -> None:
        for name in ("admission", "residency", "session_lifecycle"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.scope not in ("train", "all"):
            raise ValueError(f"scope must be 'train' or 'all', got {self.scope!r}")

        def number(name: str) -> float:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
                raise ValueError(f"{name} must be a number, got {v!r}")
            return float(v)

        def in_range(name: str, lo: float, hi: float, lo_open: bool) -> None:
            v = number(name)
            ok = (v > lo if lo_open else v >= lo) and v <= hi
            if not ok:
                raise ValueError(f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}")

        def check_decode_cap() -> None:
            cap = self.expected_decode_cap
            if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0):
                raise ValueError(f"expected_decode_cap must be a positive int or None, got {cap!r}")
            if cap is not None and cap > 2**31 - 1:
                raise ValueError(f"expected_decode_cap must be at most {2**31 - 1}, got {cap}")

        checks = {
            "headroom": lambda: in_range("headroom", 0.0, 1.0, True),
            "pressure_threshold": lambda: in_range("pressure_threshold", 0.0, 1.0, True),
            "expected_decode_cap": check_decode_cap,
            "high_watermark": lambda: in_range("high_watermark", 0.0, 1.0, True),
            "hit_threshold": lambda: in_range("hit_threshold", 0.0, 1.0, False),
        }
        used: dict[str, Any] = {}
        for name, feature in FEATURE_KNOBS.items():
            try:
                checks[name]()
                used[name] = getattr(self, name)
            except ValueError:
                if getattr(self, feature):
                    raise
                # SPEC 6: not validated while its feature is off, and so never used as given
                used[name] = _FIELD_DEFAULTS[name]
        object.__setattr__(self, "_effective", used)
        if self.residency:
            if self.admission and number("high_watermark") > number("pressure_threshold"):
                raise ValueError(
                    f"high_watermark ({self.high_watermark}) must be <= pressure_threshold "
                    f"({self.pressure_threshold})")
        for name, lo_open in (("max_wait_s", False), ("max_wait_hard_s", False), ("wait_poll_s", True), ("idle_grace_s", False), ("lease_ttl_s", True), ("staleness_s", True),
                              ("redis_timeout_s", True), ("probe_timeout_s", True),
                              ("close_timeout_s", True)):
            v = number(name)
            if (v <= 0 if lo_open else v < 0) or math.isinf(v):
                raise ValueError(f"{name} must be {'> 0' if lo_open else '>= 0'} and finite, got {v}")
            if name.endswith("_s") and v > MAX_SECONDS:
                # the scripts get milliseconds as integers: past ~2**63 ms they would wrap
                # negative (a lease that expires at once); no wait or grace is ever that long
                raise ValueError(f"{name} must be at most {MAX_SECONDS:g} s, got {v:g}")
        if self.max_wait_hard_s < self.max_wait_s:
            raise ValueError(f"max_wait_hard_s ({self.max_wait_hard_s:g}) must be >= max_wait_s "
                             f"({self.max_wait_s:g})")
        if self.budget_scale is not None:
            b = self.budget_scale
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) or b <= 0:
                raise ValueError(f"budget_scale must be a finite number > 0 or None, got {b!r}")
        if isinstance(self.reap_batch, bool) or not isinstance(self.reap_batch, int) or self.reap_batch < 1:
            raise ValueError(f"reap_batch must be an int >= 1, got {self.reap_batch!r}")
        if not isinstance(self.engine_urls, tuple) or not all(isinstance(u, str) and u for u in self.engine_urls):
            raise ValueError(f"engine_urls must be a tuple of base URLs, got {self.engine_urls!r}")
        for u in self.engine_urls:
            normalize_base_url(u)  # ValueError naming the URL: the close fan-out would refuse it later

    def effective(self, name: str) -> Any:
        """The value the gate uses for knob ``name``: the knob itself, except for a knob of a
        feature that is off whose value would not pass validation (SPEC 6 does not check it
        then), which is replaced by its default."""
        used = self.__dict__.get("_effective")
        if used is None:
            self.validate()
            used = self.__dict__["_effective"]
        return used[name] if name in used else getattr(self, name)

    @property
    def gating(self) -> bool:
        """Rule 1: a gate with neither admission nor residency passes everything through."""
        return self.admission or self.residency

    def replace(self, **changes: Any) -> "GateConfig":
        return dataclasses.replace(self, **changes)

    # -- environment ------------------------------------------------------------------
    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, base: "GateConfig | None" = None,
                 **overrides: Any) -> "GateConfig":
        """Knobs from ``KVGATE_<KNOB>`` variables (``KVGATE_MAX_WAIT_S=10``), over ``base``,
        under explicit ``overrides``. A malformed value raises ValueError naming the variable."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in fields(cls):
            var = "KVGATE_" + f.name.upper()
            if var in env:
                values[f.name] = parse_value(f.name, env[var], var)
        values.update({k: v for k, v in overrides.items() if v is not None})
        base = base or cls()
        return dataclasses.replace(base, **values)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["engine_urls"] = list(self.engine_urls)
        return d


#: the knobs validated only while their feature is on (SPEC section 6), and that feature
FEATURE_KNOBS: dict[str, str] = {
    "headroom": "admission", "pressure_threshold": "admission", "expected_decode_cap": "admission",
    "high_watermark": "residency", "hit_threshold": "residency",
}

_FIELD_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(GateConfig)
                                   if f.default is not dataclasses.MISSING}

KNOB_TYPES: dict[str, type] = {
    "admission": bool, "residency": bool, "session_lifecycle": bool, "headroom": float,
    "pressure_threshold": float, "high_watermark": float, "hit_threshold": float,
    "expected_decode_cap": int, "max_wait_s": float, "max_wait_hard_s": float, "wait_poll_s": float,
    "idle_grace_s": float, "lease_ttl_s": float, "staleness_s": float, "scope": str,
    "redis_timeout_s": float, "probe_timeout_s": float, "close_timeout_s": float,
    "reap_batch": int, "engine_urls": tuple, "budget_scale": float,
}


def parse_value(name: str, raw: str, source: str | None = None) -> Any:
    """Parse one knob from text (environment or CLI)."""
    where = source or name
    typ = KNOB_TYPES.get(name)
    if typ is None:
        raise ValueError(f"unknown knob {name!r}")
    s = raw.strip()
    try:
        if typ is bool:
            if s.lower() in _TRUE:
                return True
            if s.lower() in _FALSE:
                return False
            raise ValueError("expected one of 1/0, true/false, yes/no, on/off")
        if typ is int:
            if name == "expected_decode_cap" and s.lower() in ("", "none"):
                return None
            return int(s)
        if typ is float:
            if name == "budget_scale" and s.lower() in ("", "none", "auto"):
                return None
            return float(s)
        if typ is tuple:
            return tuple(u.strip() for u in s.split(",") if u.strip())
        return s
    except ValueError as e:
        raise ValueError(f"{where}={raw!r}: {e}") from None
