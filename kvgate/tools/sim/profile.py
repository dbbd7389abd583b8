"""Cost profiles of the engine simulator (JSON files in ``kvgate/tools/sim/profiles/``).

A profile is loaded by name (the file stem) or by path.  The required fields are
the shared contract (see ``profiles/README.md``); the optional ones have defaults
taken from SGLang's scheduler.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Dict, List, Mapping, Optional, Union

DEFAULT_PROFILE = "gpu-h100-30b"

_REQUIRED = ("block_size", "kv_capacity_tokens", "prefill_base_s", "prefill_s_per_token",
             "decode_step_base_s", "decode_step_per_seq_s", "max_running_requests",
             "max_prefill_tokens")


@dataclass(frozen=True)
class Profile:
    """Engine-time cost model and pool geometry of one simulated engine.

    Times are engine seconds, before the simulator's ``time_scale``.
    """

    name: str
    block_size: int
    kv_capacity_tokens: int
    prefill_base_s: float
    prefill_s_per_token: float
    decode_step_base_s: float
    decode_step_per_seq_s: float
    max_running_requests: int
    max_prefill_tokens: int
    source: str = ""
    # optional (sim-specific) fields
    decode_s_per_kv_token: float = 0.0       # attention read cost per token in the running batch
    context_length: Optional[int] = None     # None = kv_capacity_tokens
    vocab_size: int = 151936
    model_name: str = "sim/model"
    init_new_token_ratio: float = 0.7        # SGLang global_config defaults
    min_new_token_ratio_factor: float = 0.14
    new_token_ratio_decay_steps: int = 600
    extra: Dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(f"profile {self.name!r}: {msg}")
        for k in ("block_size", "kv_capacity_tokens", "max_running_requests",
                  "max_prefill_tokens", "vocab_size", "new_token_ratio_decay_steps"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                bad(f"{k} must be an integer >= 1, got {v!r}")
        for k in ("prefill_base_s", "prefill_s_per_token", "decode_step_base_s",
                  "decode_step_per_seq_s", "decode_s_per_kv_token"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                bad(f"{k} must be a number >= 0, got {v!r}")
        if self.kv_capacity_tokens < self.block_size:
            bad("kv_capacity_tokens must hold at least one block")
        if self.context_length is not None and (
                isinstance(self.context_length, bool) or not isinstance(self.context_length, int)
                or self.context_length < 1):
            bad(f"context_length must be an integer >= 1 or null, got {self.context_length!r}")
        if not 0 < self.init_new_token_ratio <= 1:
            bad("init_new_token_ratio must be in (0, 1]")
        if not 0 < self.min_new_token_ratio_factor <= 1:
            bad("min_new_token_ratio_factor must be in (0, 1]")

    @property
    def max_context(self) -> int:
        return self.context_length or self.kv_capacity_tokens

    def replace(self, **overrides: Any) -> "Profile":
        """A copy with some fields changed (``kv_capacity_tokens=...`` etc.)."""
        return dataclasses.replace(self, **overrides)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], name: Optional[str] = None) -> "Profile":
        if not isinstance(data, Mapping):
            raise ValueError("a profile must be a JSON object")
        missing = [k for k in _REQUIRED if k not in data]
        pname = str(data.get("name") or name or "?")
        if missing:
            raise ValueError(f"profile {pname!r} lacks required fields: {', '.join(missing)}")
        known = {f.name for f in dataclasses.fields(cls)} - {"extra", "name"}
        kwargs = {k: v for k, v in data.items() if k in known}
        extra = {k: v for k, v in data.items() if k not in known and k != "name"}
        return cls(name=pname, extra=extra, **kwargs)

    def to_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        extra = d.pop("extra")
        d.update(extra)
        return d


def _profiles_dir():
    return resources.files("kvgate.tools.sim").joinpath("profiles")


def available_profiles() -> List[str]:
    """Names of the profiles shipped in ``kvgate/tools/sim/profiles/``."""
    try:
        return sorted(p.name[:-5] for p in _profiles_dir().iterdir()
                      if p.name.endswith(".json"))
    except (FileNotFoundError, NotADirectoryError):  # pragma: no cover
        return []


def load_profile(name_or_path: Union[str, os.PathLike, Profile, Mapping[str, Any], None] = None,
                 **overrides: Any) -> Profile:
    """Load a profile by name (file stem), by path, or from a dict; apply overrides.

    ``load_profile()`` gives the default ``gpu-h100-30b``.  Unknown names raise a
    ValueError that lists the available profiles.
    """
    if name_or_path is None:
        name_or_path = DEFAULT_PROFILE
    if isinstance(name_or_path, Profile):
        prof = name_or_path
    elif isinstance(name_or_path, Mapping):
        prof = Profile.from_dict(name_or_path)
    else:
        s = os.fspath(name_or_path)
        if not isinstance(s, str) or not s:
            raise ValueError(f"profile name must be a non-empty string, got {name_or_path!r}")
        looks_like_path = s.endswith(".json") or os.sep in s or (os.altsep and os.altsep in s)
        if looks_like_path:
            if not os.path.isfile(s):
                raise ValueError(f"profile file not found: {s}")
            with open(s, "r", encoding="utf-8") as f:
                data = json.load(f)
            prof = Profile.from_dict(data, name=os.path.basename(s)[:-5])
        else:
            res = _profiles_dir().joinpath(s + ".json")
            if not res.is_file():
                avail = available_profiles()
                raise ValueError(
                    f"unknown simulator profile {s!r}; available: "
                    f"{', '.join(avail) if avail else '(none)'} (or pass a path to a .json file)")
            prof = Profile.from_dict(json.loads(res.read_text(encoding="utf-8")), name=s)
    if overrides:
        prof = prof.replace(**overrides)
    return prof
