"""JSONL trace replay: a recorded rollout as a :class:`.workload.Workload`, every line checked.

The format (one turn per line, and the optional keys that say which prefixes sessions share)
is in docs/benchmarks.md#trace-replay.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterable

from .workload import MAX_GAP_S, MAX_REQUEST_TOKENS, VOCAB_DEFAULT, SessionSpec, TurnSpec, Workload

__all__ = ["load_trace", "parse_trace"]

_TRACE_KEYS = ("session", "turn", "input_tokens", "output_tokens", "gap_s")


def load_trace(path: str | Path, *, seed: int = 0, vocab: int = VOCAB_DEFAULT) -> Workload:
    """Replay a JSONL trace: one ``{"session", "turn", "input_tokens", "output_tokens", "gap_s"}`` per line.

    ``input_tokens`` is the full prompt of that turn (history included); when it is at
    least the previous turn's prompt + output, the difference is the new tool result,
    otherwise the context was reset or truncated and the turn starts from fresh tokens.
    ``gap_s`` is the wait before the turn (for a session's first turn: its arrival offset).
    Optional keys say what sessions share: ``group`` (the task a session samples; on any of
    its lines, the same on each), ``shared_tokens`` (on its first turn: the leading tokens of
    its first prompt that its group's sessions all send; the same for every session of a
    group) and ``system_tokens`` (on a first turn: the leading tokens every session's first
    prompt shares; the same wherever given).
    Blank lines and lines starting with ``#`` are skipped.  Any bad line raises a
    ValueError naming its line number.
    """
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ValueError(f"trace {p}: cannot read ({e})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ValueError(f"{p}: line {line}: not UTF-8 text (byte {raw[e.start]:#04x})") from None
    # lines end at "\n" only: JSON strings may hold U+2028, U+2029 or U+0085 raw, which
    # str.splitlines() would also split on (and shift every later line number)
    return parse_trace((ln.removesuffix("\r") for ln in text.split("\n")),
                       seed=seed, vocab=vocab, name=str(p))


def parse_trace(lines: Iterable[str], *, seed: int = 0, vocab: int = VOCAB_DEFAULT,
                name: str = "trace") -> Workload:
    rows: dict[str, dict[int, tuple[int, int, int, float]]] = {}
    order: list[str] = []
    kinds: dict[str, type] = {}
    sharing = _TraceSharing(name)
    for lineno, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{name}: line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        missing = [k for k in _TRACE_KEYS if k not in obj]
        if missing:
            raise ValueError(f"{where}: missing key(s) {', '.join(missing)}")
        sess = obj["session"]
        if isinstance(sess, bool) or not isinstance(sess, (str, int)) or str(sess) == "":
            raise ValueError(f"{where}: 'session' must be a non-empty string or an integer, got {sess!r}")
        turn, inp, out, gap = obj["turn"], obj["input_tokens"], obj["output_tokens"], obj["gap_s"]
        for key, val, lo in (("turn", turn, 0), ("input_tokens", inp, 1), ("output_tokens", out, 1)):
            if isinstance(val, bool) or not isinstance(val, int) or val < lo:
                raise ValueError(f"{where}: {key!r} must be an integer >= {lo}, got {val!r}")
        for key, val in (("input_tokens", inp), ("output_tokens", out)):
            if val > MAX_REQUEST_TOKENS:
                raise ValueError(f"{where}: {key!r} must be <= {MAX_REQUEST_TOKENS:,}, got {val!r}")
        if inp + out > MAX_REQUEST_TOKENS:
            raise ValueError(f"{where}: input_tokens + output_tokens must be <= {MAX_REQUEST_TOKENS:,}, "
                             f"got {inp + out:,}")
        if (isinstance(gap, bool) or not isinstance(gap, (int, float)) or not math.isfinite(gap)
                or not 0 <= gap <= MAX_GAP_S):
            raise ValueError(f"{where}: 'gap_s' must be a number of seconds in [0, {MAX_GAP_S:g}], got {gap!r}")
        sid = str(sess)
        if sid not in rows:
            rows[sid] = {}
            order.append(sid)
            kinds[sid] = type(sess)
        elif kinds[sid] is not type(sess):
            raise ValueError(f"{where}: session {sess!r} was a {kinds[sid].__name__} on an earlier "
                             f"line; use one spelling, or two different ids, per session")
        if turn in rows[sid]:
            raise ValueError(f"{where}: duplicate turn {turn} of session {sid!r} "
                             f"(first seen on line {rows[sid][turn][0]})")
        rows[sid][turn] = (lineno, inp, out, float(gap))
        sharing.read(obj, sid, turn, where)
    if not rows:
        raise ValueError(f"{name}: no turns (empty trace)")
    sessions = []
    for sid in order:
        turns = []
        prev_total = 0
        for idx, t in enumerate(sorted(rows[sid])):
            lineno, inp, out, gap = rows[sid][t]
            if idx > 0 and inp >= prev_total:
                turns.append(TurnSpec(turn=t, new_tokens=inp - prev_total, output_tokens=out, gap_s=gap,
                                      line=lineno))
            elif idx == 0:
                turns.append(TurnSpec(turn=t, new_tokens=inp, output_tokens=out, gap_s=gap, line=lineno))
            else:
                turns.append(TurnSpec(turn=t, new_tokens=0, output_tokens=out, gap_s=gap, reset_to=inp,
                                      line=lineno))
            prev_total = inp + out
        group, shared = sharing.of(sid, turns[0])
        sessions.append(SessionSpec(session_id=sid, turns=tuple(turns), group=group, shared_tokens=shared))
    return Workload(sessions=tuple(sessions), seed=seed, vocab=vocab, source=f"trace:{name}",
                    spec={"trace": name}, system_tokens=sharing.system or 0)


class _TraceSharing:
    """The optional sharing keys of a trace (``group``, ``shared_tokens``, ``system_tokens``),
    checked as lines are read, and each session's group and shared length at the end."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.group: dict[str, tuple[str, int]] = {}       # session -> (group, line)
        self.shared: dict[str, tuple[int, int, int]] = {}  # session -> (tokens, turn, line)
        self.group_shared: dict[str, tuple[int, int]] = {}  # group -> (tokens, line)
        self.system: int | None = None
        self.system_line = 0
        self.firsts: dict[str, tuple[int, int]] = {}  # session -> (turn, line) of a system_tokens

    def read(self, obj: dict, sid: str, turn: int, where: str) -> None:
        if "group" in obj:
            g = obj["group"]
            if isinstance(g, bool) or not isinstance(g, (str, int)) or str(g) == "":
                raise ValueError(f"{where}: 'group' must be a non-empty string or an integer, got {g!r}")
            g = str(g)
            seen = self.group.setdefault(sid, (g, 0))
            if seen[0] != g:
                raise ValueError(f"{where}: session {sid!r} is in group {seen[0]!r} on an earlier line, "
                                 f"here {g!r}: a session samples one task")
        for key in ("shared_tokens", "system_tokens"):
            if key not in obj:
                continue
            v = obj[key]
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= obj["input_tokens"]:
                raise ValueError(f"{where}: {key!r} must be an integer in [0, input_tokens], got {v!r}")
            if key == "shared_tokens":
                self.shared[sid] = (v, turn, int(where.rsplit(" ", 1)[1]))
            else:
                if self.system is not None and v != self.system:
                    raise ValueError(f"{where}: 'system_tokens' {v} differs from {self.system} on line "
                                     f"{self.system_line}: a workload has one system prompt")
                self.system, self.system_line = v, int(where.rsplit(" ", 1)[1])
                self.firsts[sid] = (turn, self.system_line)

    def of(self, sid: str, first: TurnSpec) -> tuple[str | None, int]:
        """The session's group and shared tokens, checked against its first turn."""
        for key, (turn, line) in (("shared_tokens", self.shared.get(sid, (0, first.turn, 0))[1:]),
                                  ("system_tokens", self.firsts.get(sid, (first.turn, 0)))):
            if turn != first.turn:
                raise ValueError(f"{self.name}: line {line}: {key!r} belongs on session {sid!r}'s first "
                                 f"turn ({first.turn}), not on turn {turn}")
        if self.system is not None and first.new_tokens < self.system:
            raise ValueError(f"{self.name}: line {first.line}: session {sid!r}'s first prompt "
                             f"({first.new_tokens} tokens) is shorter than the system prompt ({self.system})")
        group = self.group.get(sid, (None, 0))[0]
        shared = self.shared.get(sid, (0, 0, 0))[0]
        if group is None:
            if shared:
                raise ValueError(f"{self.name}: session {sid!r} gives 'shared_tokens' but no 'group'")
            return None, 0
        known = self.group_shared.setdefault(group, (shared, first.line or 0))
        if known[0] != shared:
            raise ValueError(f"{self.name}: line {first.line}: session {sid!r} shares {shared} tokens of group "
                             f"{group!r}, another session {known[0]} (line {known[1]}): a group has one prompt")
        return group, shared
