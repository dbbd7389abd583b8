"""What a kvgate Redis user must be allowed to run, and how a refusal is told apart from a
fault.

A Redis fault (a refused connection, a timeout) is transient: turns bypass as ``degraded``
and the gate resumes by itself. A refusal (``NOPERM``: the ACL user lacks a command, a key
pattern or a channel; a wrong password) is a configuration error that no retry fixes: failing
open on it would bypass every turn for as long as the process runs. The drivers therefore
raise ``kvgate.RedisAccessDenied`` for a refusal, naming what is missing: Redis names the
command of a refused plain command, but for a command refused inside a script it says only
"the user executing the script can't run this command", so the drivers then send
``probe_commands`` (harmless commands on scratch keys of the gate's own slot) and name each
one refused. docs/deploy.md#acl has the ACL line that grants ``REQUIRED_COMMANDS``.
"""
from __future__ import annotations

from typing import Any, Sequence

import redis

from .. import keys as _keys
from .flows import Command, Pipeline

#: every command a gate, its poller and the CLI send, directly or from their scripts (kvgate's
#: in lua/, redis-py's lock scripts), lower-case as ACL rules name them. Connecting sends
#: AUTH (always allowed); redis-py's CLIENT SETINFO may be refused (it ignores that).
REQUIRED_COMMANDS = (
    # calling the scripts (kvgate/client/scripts.py ScriptCaller): the function library (FCALL,
    # and FUNCTION LOAD where the server lacks it); EVALSHA and SCRIPT LOAD where the server
    # has no functions (Redis 6.2) or the user may not run them
    "fcall", "function|load", "evalsha", "script|load",
    # inside kvgate's scripts, and the gate's plain reads and counters
    "hget", "hmget", "hgetall", "hvals", "hlen", "hrandfield", "hset", "hincrby", "hincrbyfloat",
    "hdel", "zadd", "zcard", "zrange", "zrangebyscore", "zrank", "zrevrange", "zscore", "zrem",
    "del", "time", "publish",
    # inside the scripts: the server's run_id, which tells a failover (common.lua server_id)
    "info",
    # the waiters' wake-ups (pub/sub on the gate's channel)
    "subscribe", "unsubscribe",
    # the poller's leader lease (redis-py's Lock: SET NX PX, and its scripts) and `kvgate status`
    "get", "set", "pexpire", "pttl",
)

_SCRIPT_REFUSAL = "the user executing the script can't"


def is_refusal(error: BaseException | None) -> bool:
    """True for what Redis answers a user it does not allow: NOPERM (a plain command; a
    command, key or channel inside a script) or a failed AUTH."""
    if isinstance(error, (redis.exceptions.NoPermissionError, redis.exceptions.AuthenticationError)):
        return True
    return isinstance(error, redis.exceptions.ResponseError) and _SCRIPT_REFUSAL in str(error).lower()


def probe_commands(gate: str) -> Pipeline:
    """One harmless call of each required command that can be pipelined (not the pub/sub
    ones), on scratch keys of the gate's slot (a hash, a sorted set, a string, deleted at the
    end) and its channel (a message no listener acts on). Redis checks the same ACL rules for
    a command sent directly as for one a script runs."""
    h, z, s = (_keys.key(gate, f"access_check:{t}") for t in ("h", "z", "s"))
    calls: list[tuple] = [
        ("HGET", h, "f"), ("HMGET", h, "f"), ("HGETALL", h), ("HVALS", h), ("HLEN", h), ("HRANDFIELD", h),
        ("HSET", h, "f", 0), ("HINCRBY", h, "f", 0), ("HINCRBYFLOAT", h, "f", 0), ("HDEL", h, "f"),
        ("ZADD", z, 0, "m"), ("ZCARD", z), ("ZRANGE", z, 0, 0), ("ZRANGEBYSCORE", z, 0, 0), ("ZRANK", z, "m"),
        ("ZREVRANGE", z, 0, 0), ("ZSCORE", z, "m"), ("ZREM", z, "m"),
        ("GET", s), ("SET", s, "0", "PX", 60000), ("PEXPIRE", s, 60000), ("PTTL", s),
        ("TIME",), ("INFO", "server"), ("PUBLISH", _keys.channel(gate), "c access-check"),
        ("SCRIPT", "LOAD", "return 0"), ("EVALSHA", "0" * 40, 0),
        # a function that does not exist, and a library that fails to load: nothing is kept
        ("FCALL", "kvgate_access_check", 0), ("FUNCTION", "LOAD", "#!lua name=kvgate_access_check\nerror('check')"),
        ("DEL", h, z, s),
    ]
    return Pipeline(tuple(Command("execute_command", c) for c in calls))


def refused_in(probe: Pipeline, replies: Sequence[Any]) -> list[str]:
    """What the probe's replies say is refused, one entry per refused probe: "hset (NOPERM
    this user has no permissions to run the 'hset' command)"; a key or channel outside the
    user's patterns is named the same way."""
    out = []
    for cmd, reply in zip(probe.commands, replies):
        if isinstance(reply, redis.exceptions.NoPermissionError):
            name = " ".join(str(a) for a in cmd.args[:2]) if cmd.args[0] in ("SCRIPT", "FUNCTION") else str(cmd.args[0])
            out.append(f"{name.lower()} (NOPERM {reply})")
    return out


def refusal_message(gate: str, error: BaseException, refused: list[str] | None) -> str:
    """The error a refused gate raises: Redis's own words, and what the probe found."""
    msg = f"gate {gate!r}: Redis refused kvgate's user ({type(error).__name__}: {error})"
    if refused:
        msg += "; refused: " + "; ".join(refused)
    return msg + ". Grant the ACL in docs/deploy.md#acl (this is a configuration error, not a fault: no retry fixes it)"
