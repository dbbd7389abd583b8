"""Command-line flags for GateConfig knobs, shared by ``kvgate`` (poller, status, top) and
``kvgate bench``.

One flag per knob (``--max-wait-s 10``, ``--admission/--no-admission``); a flag wins over
the ``KVGATE_*`` environment, which wins over the defaults. The flags follow GateConfig's
fields, so a knob added or retired there needs no change here.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Mapping

__all__ = ["add_knob_arguments", "config_from_args", "KNOB_DEST_PREFIX"]

#: argparse destinations of the knob flags start with this, so they never collide with a
#: command's own flags (``--redis``, ``--engine``)
KNOB_DEST_PREFIX = "knob_"


def _knob_fields() -> list[dataclasses.Field]:
    from kvgate.config import GateConfig

    return [f for f in dataclasses.fields(GateConfig) if f.init]


def add_knob_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add one flag per GateConfig knob (group "gate knobs"). Unset flags stay None so the
    environment / defaults apply."""
    from kvgate.config import KNOB_TYPES

    g = parser.add_argument_group("gate knobs", "every knob also reads KVGATE_<KNOB> from the environment; "
                                                "flags win")
    for f in _knob_fields():
        flag = "--" + f.name.replace("_", "-")
        dest = KNOB_DEST_PREFIX + f.name
        typ = KNOB_TYPES.get(f.name)
        default = f.default if f.default is not dataclasses.MISSING else "()"
        if typ is bool:
            g.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=None,
                           help=f"(default {default}; env KVGATE_{f.name.upper()})")
        else:
            metavar = {"engine_urls": "URL[,URL...]", "scope": "{train,all}"}.get(f.name, f.name.upper().split("_")[-1])
            g.add_argument(flag, dest=dest, default=None, metavar=metavar,
                           help=f"(default {default}; env KVGATE_{f.name.upper()})")
    return parser


def config_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None):
    """GateConfig from defaults < ``KVGATE_*`` environment < flags. ValueError on bad input."""
    from kvgate.config import GateConfig, parse_value

    overrides: dict[str, Any] = {}
    for f in _knob_fields():
        raw = getattr(args, KNOB_DEST_PREFIX + f.name, None)
        if raw is None:
            continue
        overrides[f.name] = raw if isinstance(raw, bool) else parse_value(
            f.name, str(raw), "--" + f.name.replace("_", "-"))
    cfg = GateConfig.from_env(env, **overrides)
    # from_env reads a None override as "not given"; a flag that parsed to None
    # (--expected-decode-cap none) was given, and beats the environment
    given_none = {k: None for k, v in overrides.items() if v is None}
    return dataclasses.replace(cfg, **given_none) if given_none else cfg
