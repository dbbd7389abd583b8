"""The policies a bench run compares, and how a gate policy's GateConfig is made.

* ``none``       every turn goes straight to the engines;
* ``cap-N``      a fixed per-session cap: at most N sessions are active (between their
                 first turn and their end) at once; others wait FIFO to start.  This is the
                 naive alternative kvgate is measured against; ``cap`` is the sweep
                 (:mod:`.sweep`);
* ``turncap-N``  at most N turns in flight at once (optional; a per-request cap);
* ``admission``  kvgate with ``GateConfig(admission=True, residency=False)``;
* ``residency``  kvgate with ``GateConfig(admission=False, residency=True)`` and the HTTP probe;
* ``kvgate``     both features, default knobs, HTTP probe;
* ``kvgate[k=v,...]`` (any gate policy) with some knobs of its own;
* ``kvgate-noshare`` (any gate policy, with or without knobs: ``admission-noshare[...]``)
  the same gate, but the workload does not tell it which prefixes sessions share: every
  session is charged its whole prompt, as a caller that passes no ``prefix_key`` is. A
  switch of the bench, not a knob of the gate.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Sequence

__all__ = ["Policy", "parse_policies", "split_policies", "scaled_gate_config", "GATE_POLICIES", "FULL_GATE",
           "NOSHARE", "NOSHARE_GATE"]

#: the full gate with default knobs: the policy every target is judged on
FULL_GATE = "kvgate"
#: the suffix of a gate policy whose turns do not say which prefix they share
NOSHARE = "-noshare"
#: the full gate told nothing of shared prefixes: what sharing is judged against
NOSHARE_GATE = FULL_GATE + NOSHARE

GATE_POLICIES = {
    "admission": (True, False),
    "residency": (False, True),
    "kvgate": (True, True),
}


@dataclass(frozen=True)
class Policy:
    name: str
    kind: str  # none | cap | turncap | gate
    cap: int | None = None
    admission: bool = False
    residency: bool = False
    knobs: tuple = ()  # (name, value) GateConfig overrides of this policy only
    share_prefix: bool = True  # gate policies: turns say which prefix they share (prefix_key)


def split_policies(text: str) -> list[str]:
    """Split on commas outside brackets: ``none,kvgate[max_wait_s=600,headroom=0.8]``."""
    items, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in policies {text!r}")
        if ch == "," and depth == 0:
            items.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise ValueError(f"unbalanced '[' in policies {text!r}")
    items.append("".join(cur))
    return items


def _policy_knobs(name: str, body: str) -> tuple:
    """``k=v,...`` of a gate policy: each name must be a field of GateConfig as it is now (so
    the bench follows the knobs the gate has), each value parses as that knob."""
    from kvgate.config import GateConfig, parse_value

    known = {f.name for f in fields(GateConfig) if f.init}
    out = []
    for item in body.split(","):
        k, sep, v = item.partition("=")
        k = k.strip()
        if not sep or not k:
            raise ValueError(f"bad policy {name!r}: expected NAME=VALUE inside [...], got {item.strip()!r}")
        if k in ("admission", "residency"):
            raise ValueError(f"bad policy {name!r}: unknown knob {k!r} (admission and residency are set by "
                             f"the policy's base name)")
        if k not in known:
            raise ValueError(f"bad policy {name!r}: unknown knob {k!r}")
        try:
            out.append((k, parse_value(k, v)))
        except ValueError as e:
            raise ValueError(f"bad policy {name!r}: {e}") from None
    return tuple(out)


def parse_policies(text: str | Sequence[str], caps: Sequence[int]) -> list[Policy]:
    """``none,cap,admission,residency,kvgate`` -> policies; ``cap`` expands to one per cap
    (none for no caps).

    A gate policy may carry its own knobs: ``kvgate[max_wait_s=600,idle_grace_s=120]`` runs
    the full gate with those two knobs changed (in unscaled seconds, like ``--knob``), so
    several settings can be compared side by side in one run."""
    items = split_policies(text) if isinstance(text, str) else list(text)
    out: list[Policy] = []
    for raw in items:
        name = raw.strip()
        if not name:
            continue
        base, bracket, rest = name.partition("[")
        base = base.strip()
        share = not base.endswith(NOSHARE)
        if not share:
            base = base[:-len(NOSHARE)]
        if bracket:
            if not rest.endswith("]") or base not in GATE_POLICIES:
                raise ValueError(f"bad policy {name!r}: knobs in [...] follow a gate policy "
                                 f"(admission, residency, kvgate, each also with -noshare) and close the name")
            adm, res = GATE_POLICIES[base]
            out.append(Policy(name, "gate", admission=adm, residency=res,
                              knobs=_policy_knobs(name, rest[:-1]), share_prefix=share))
            continue
        if not share and base in GATE_POLICIES:
            adm, res = GATE_POLICIES[base]
            out.append(Policy(name, "gate", admission=adm, residency=res, share_prefix=False))
            continue
        if name == "none":
            out.append(Policy("none", "none"))
        elif name in ("cap", "turncap"):
            # no caps: the sweep derived none below the number of sessions (every session
            # fits; a cap of all of them is no gate), so the sweep runs nothing
            out.extend(Policy(f"{name}-{c}", name, cap=c) for c in caps)
        elif name.startswith("cap-") or name.startswith("turncap-"):
            kind, _, n = name.partition("-")
            try:
                c = int(n)
            except ValueError:
                raise ValueError(f"bad policy {name!r}: expected {kind}-N with an integer N") from None
            if c < 1:
                raise ValueError(f"bad policy {name!r}: the cap must be >= 1")
            out.append(Policy(name, kind, cap=c))
        elif name in GATE_POLICIES:
            adm, res = GATE_POLICIES[name]
            out.append(Policy(name, "gate", admission=adm, residency=res))
        else:
            raise ValueError(f"unknown policy {name!r}: use none, cap, cap-N, turncap-N, "
                             f"admission, residency, kvgate (a gate policy also with {NOSHARE})")
    if not out:
        raise ValueError("no policies given")
    names = [p.name for p in out]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ValueError(f"policy given twice: {', '.join(sorted(dup))}")
    return out


def scaled_gate_config(base: Any, policy: Policy, time_scale: float, scale_knobs: bool = True) -> Any:
    """Per-policy GateConfig: features from the policy, time knobs scaled with the workload.

    The workload's tool latencies and the engines' costs are multiplied by ``time_scale``;
    so are the gate's own durations (idle grace, max wait, wait poll), keeping every ratio
    the same as in an unscaled run.  ``staleness_s`` and ``lease_ttl_s`` are safety
    timeouts, not dynamics, and stay as they are.
    """
    if policy.knobs:
        try:
            base = replace(base, **dict(policy.knobs))
        except TypeError as e:
            raise ValueError(f"policy {policy.name!r}: {e}") from None
    kw = {"admission": policy.admission, "residency": policy.residency}
    if scale_knobs and time_scale != 1.0:
        for k in ("idle_grace_s", "max_wait_s", "max_wait_hard_s", "wait_poll_s"):
            v = getattr(base, k, None)
            if v is not None:
                kw[k] = max(v * time_scale, 0.01) if v > 0 else v
    return replace(base, **kw)
