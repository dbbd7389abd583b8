"""Fast JSON for long token-id lists: orjson where installed (the ``bench`` extra: several
times faster, and the bench's client is CPU-bound at its time scale), else the standard
library. ``dumps`` returns compact bytes; ``loads`` takes bytes or str."""
from __future__ import annotations

from typing import Any

try:
    import orjson as _orjson

    def dumps(o: Any) -> bytes:
        return _orjson.dumps(o)

    loads = _orjson.loads
except ImportError:  # pragma: no cover - depends on the environment
    import json as _json

    def dumps(o: Any) -> bytes:
        return _json.dumps(o, separators=(",", ":")).encode()

    loads = _json.loads
