"""kvgate's exceptions."""
from __future__ import annotations


class KvgateError(Exception):
    """Base class of kvgate's own exceptions."""


class Preempted(KvgateError):
    """A waiting attempt was superseded by a newer attempt of the same session (or the
    session was finished while it waited). Counted in that session's ``num_preempted``."""

    def __init__(self, session_id: str, ticket: str, reason: str = "preempted"):
        super().__init__(f"attempt {ticket} of session {session_id!r} was {reason.replace('_', ' ')}")
        self.session_id = session_id
        self.ticket = ticket
        self.reason = reason


class AdmissionCancelled(KvgateError):
    """The caller's ``abort_event`` was set while the attempt waited; its waiter was removed
    (or a lease granted at the same moment was released)."""


class AdmissionTimeout(KvgateError, TimeoutError):
    """``acquire(timeout_s=...)`` ran out while waiting; the attempt was cancelled cleanly."""


class ScriptError(KvgateError):
    """A kvgate Lua script returned something it should not have (a bug, not a fault)."""


class RedisAccessDenied(KvgateError):
    """Redis refused kvgate's user: NOPERM (the ACL user lacks a command, a key pattern or a
    channel kvgate needs; docs/deploy.md#acl) or a failed AUTH. A configuration error, raised
    rather than failed open on: a gate that bypassed every turn as ``degraded`` would hide it
    for as long as the process runs. ``error`` is what redis-py raised."""

    def __init__(self, message: str, error: BaseException | None = None):
        super().__init__(message)
        self.error = error
