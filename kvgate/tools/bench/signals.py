"""SIGTERM during a bench run: stop it as Ctrl-C does, so nothing it started is orphaned."""
from __future__ import annotations

import contextlib
import signal
import threading

__all__ = ["Terminated", "sigterm_interrupts"]


class Terminated(KeyboardInterrupt):
    """SIGTERM during a bench run. A subclass, not ``KeyboardInterrupt`` itself: CPython
    remembers an exact ``KeyboardInterrupt`` that escapes any ``exec`` of a string (dataclass
    and namedtuple creation run one) and, under ``python -m``, then ends the process with
    SIGINT at exit even though the bench caught it and returned 130 (seen in CI as exit -2).
    The check is on the exact type, so a subclass keeps the exit code ours."""


@contextlib.contextmanager
def sigterm_interrupts():
    """SIGTERM raises Terminated (a KeyboardInterrupt) while the bench runs (main thread only), so the
    simulator's child process and the embedded redis-server are stopped by the same
    clean-up as Ctrl-C instead of being orphaned by a ``kill``."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _raise(signum, frame):
        raise Terminated(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
