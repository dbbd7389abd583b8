"""Agentic rollout workloads: seeded synthetic sessions and JSONL trace replay.

A workload is a tuple of sessions; a session is a tuple of turns.  Every turn re-sends
the whole history (all previous prompts and outputs) plus the new tokens of this turn
(the first prompt for turn 0, the tool result afterwards), so prompts grow monotonically.
Before each turn the session waits ``gap_s`` seconds: for turn 0 that is its arrival
offset from the start of the step, afterwards the tool call's latency.  Times are stored
unscaled; the runner multiplies them by ``--time-scale``.

Token ids are derived from (seed, session id) alone, so the same workload sends the same
tokens to every policy and every run.  Outputs are whatever the engine returns
(``output_ids``); the runner appends them to the history, so the next turn's prompt is a
true extension of what the engine has cached.
"""
from __future__ import annotations

import hashlib
import json
import math
import random
from array import array
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

__all__ = [
    "IntRange",
    "ToolLatency",
    "TurnSpec",
    "SessionSpec",
    "Workload",
    "WorkloadSpec",
    "generate",
    "load_trace",
    "parse_range",
    "MAX_REQUEST_TOKENS",
    "MAX_GAP_S",
    "session_tokens",
]

VOCAB_DEFAULT = 32000

# Bounds on a workload, so that a typo (a unit error, an extra zero) is a clear error before
# the run instead of a MemoryError or a wait that never ends in the middle of it:
#: the largest request (prompt + output tokens) of any turn: 2M tokens, above the longest
#: context windows served in practice (each prompt is held as a list of ids per session)
MAX_REQUEST_TOKENS = 2_000_000
#: the longest wait before a turn (a trace's gap_s, a tool call's cap, the arrival spread),
#: unscaled: one day
MAX_GAP_S = 86_400.0
#: generated workloads: sessions, and turns per session
MAX_SESSIONS = 100_000
MAX_TURNS = 10_000


@dataclass(frozen=True)
class IntRange:
    """An inclusive integer range sampled uniformly; ``lo == hi`` is a fixed value."""

    lo: int
    hi: int

    def __post_init__(self) -> None:
        if not (isinstance(self.lo, int) and isinstance(self.hi, int)):
            raise ValueError(f"range bounds must be integers, got {self.lo!r}-{self.hi!r}")
        if self.lo < 0 or self.hi < self.lo:
            raise ValueError(f"bad range {self.lo}-{self.hi}: need 0 <= lo <= hi")

    def sample(self, rng: random.Random) -> int:
        return self.lo if self.lo == self.hi else rng.randint(self.lo, self.hi)

    @property
    def mean(self) -> float:
        return (self.lo + self.hi) / 2.0

    def __str__(self) -> str:
        return str(self.lo) if self.lo == self.hi else f"{self.lo}-{self.hi}"


def parse_range(text: str | int | IntRange, *, name: str = "range", minimum: int = 0) -> IntRange:
    """Parse ``"N"`` or ``"LO-HI"`` into an :class:`IntRange` (ValueError naming ``name``)."""
    if isinstance(text, IntRange):
        r = text
    elif isinstance(text, int) and not isinstance(text, bool):
        r = IntRange(text, text)
    else:
        s = str(text).strip()
        try:
            if "-" in s[1:]:
                a, b = s[:1] + s[1:].split("-", 1)[0], s[1:].split("-", 1)[1]
                r = IntRange(int(a), int(b))
            else:
                v = int(s)
                r = IntRange(v, v)
        except ValueError as e:
            raise ValueError(f"{name}: expected N or LO-HI (integers), got {text!r} ({e})") from None
    if r.lo < minimum:
        raise ValueError(f"{name}: values must be >= {minimum}, got {r}")
    return r


@dataclass(frozen=True)
class ToolLatency:
    """Heavy-tailed tool latency: a two-component lognormal mixture, capped.

    Most tool calls are fast (file reads, greps, edits: ``fast_median_s``); a fraction
    ``slow_frac`` are slow (test runs, builds, installs: ``slow_median_s``); both have
    log-space spread ``sigma``; every call is cut at ``max_s`` (agents run tools under a
    timeout).  The defaults give a median around 0.4 s and a p90 around 12 s.
    """

    fast_median_s: float = 0.3
    slow_median_s: float = 12.0
    slow_frac: float = 0.2
    sigma: float = 0.8
    max_s: float = 60.0

    def __post_init__(self) -> None:
        for k in ("fast_median_s", "slow_median_s", "max_s"):
            v = getattr(self, k)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"tool latency {k} must be a finite number > 0, got {v!r}")
        if self.max_s > MAX_GAP_S:
            raise ValueError(f"tool latency max_s must be <= {MAX_GAP_S:g} s, got {self.max_s!r}")
        if not (0.0 <= self.slow_frac <= 1.0):
            raise ValueError(f"tool latency slow_frac must be in [0, 1], got {self.slow_frac!r}")
        if not (math.isfinite(self.sigma) and self.sigma >= 0):
            raise ValueError(f"tool latency sigma must be >= 0, got {self.sigma!r}")

    def sample(self, rng: random.Random) -> float:
        median = self.slow_median_s if rng.random() < self.slow_frac else self.fast_median_s
        return min(self.max_s, median * math.exp(self.sigma * rng.gauss(0.0, 1.0)))


@dataclass(frozen=True)
class TurnSpec:
    """One engine call of a session.

    ``new_tokens`` are appended to the history before the call (ignored when
    ``reset_to`` is set); ``output_tokens`` is the decode budget (max_new_tokens);
    ``gap_s`` the unscaled wait before the call.  ``reset_to`` (trace replay only) replaces
    the history with fresh tokens of that length: a context reset or truncation.
    """

    turn: int
    new_tokens: int
    output_tokens: int
    gap_s: float
    reset_to: int | None = None
    line: int | None = field(default=None, compare=False)  # the trace line it came from


@dataclass(frozen=True)
class SessionSpec:
    session_id: str
    turns: tuple[TurnSpec, ...]

    @property
    def start_s(self) -> float:
        return self.turns[0].gap_s if self.turns else 0.0


@dataclass(frozen=True)
class Workload:
    """Sessions plus the seed that fixes their token ids."""

    sessions: tuple[SessionSpec, ...]
    seed: int = 0
    vocab: int = VOCAB_DEFAULT
    source: str = "synthetic"
    spec: dict = field(default_factory=dict)

    @property
    def num_turns(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    def final_context_tokens(self, session: SessionSpec) -> int:
        """Prompt + output tokens of a session's last turn (its peak KV footprint)."""
        total = 0
        for t in session.turns:
            total = t.reset_to if t.reset_to is not None else total + t.new_tokens
            total += t.output_tokens
        return total

    def largest_request(self) -> tuple[int, str]:
        """The most tokens one turn asks an engine to hold (its prompt + output tokens), and
        where it is: ``"line N"`` of a trace, else ``"session S turn T"``. Outputs are taken
        at their full length (the engines are asked for exactly that many: ``ignore_eos``)."""
        best, where = 0, ""
        for s in self.sessions:
            total = 0
            for idx, t in enumerate(s.turns):
                total = t.reset_to if t.reset_to is not None else total + t.new_tokens
                total += t.output_tokens
                if total > best:
                    best = total
                    where = f"line {t.line}" if t.line is not None else f"session {s.session_id} turn {idx}"
        return best, where

    def working_set_tokens(self) -> int:
        """Sum over sessions of their final context: the KV they would all keep resident."""
        return sum(self.final_context_tokens(s) for s in self.sessions)

    def fresh_tokens(self) -> int:
        """Prompt tokens no engine can have cached: first prompts, tool results, resets."""
        n = 0
        for s in self.sessions:
            for t in s.turns:
                n += t.reset_to if t.reset_to is not None else t.new_tokens
        return n

    def total_prompt_tokens(self) -> int:
        n = 0
        for s in self.sessions:
            total = 0
            for t in s.turns:
                total = t.reset_to if t.reset_to is not None else total + t.new_tokens
                n += total
                total += t.output_tokens
        return n

    def describe(self) -> dict:
        gaps = sorted(t.gap_s for s in self.sessions for t in s.turns[1:])
        turns = sorted(len(s.turns) for s in self.sessions)

        def q(xs: Sequence[float], p: float) -> float:
            if not xs:
                return 0.0
            return float(xs[min(len(xs) - 1, int(p * len(xs)))])

        return {
            "source": self.source,
            "seed": self.seed,
            "sessions": len(self.sessions),
            "turns": self.num_turns,
            "turns_per_session_p50": q(turns, 0.5),
            "turns_per_session_max": turns[-1] if turns else 0,
            "tool_latency_p50_s": round(q(gaps, 0.5), 3),
            "tool_latency_p90_s": round(q(gaps, 0.9), 3),
            "tool_latency_mean_s": round(sum(gaps) / len(gaps), 3) if gaps else 0.0,
            "working_set_tokens": self.working_set_tokens(),
            "total_prompt_tokens": self.total_prompt_tokens(),
            "fresh_prompt_tokens": self.fresh_tokens(),
            "spec": self.spec,
        }


@dataclass(frozen=True)
class WorkloadSpec:
    """Parameters of the synthetic generator (see docs/benchmarks.md for the sources)."""

    sessions: int = 40
    turns: IntRange = IntRange(16, 32)
    first_prompt: IntRange = IntRange(1500, 2500)
    tool_result: IntRange = IntRange(100, 400)
    output: IntRange = IntRange(30, 120)
    tool: ToolLatency = ToolLatency()
    arrival_spread_s: float = 0.0
    vocab: int = VOCAB_DEFAULT

    def __post_init__(self) -> None:
        if not (isinstance(self.sessions, int) and 1 <= self.sessions <= MAX_SESSIONS):
            raise ValueError(f"sessions must be an integer in [1, {MAX_SESSIONS:,}], got {self.sessions!r}")
        if not 1 <= self.turns.lo <= self.turns.hi <= MAX_TURNS:
            raise ValueError(f"turns must be in [1, {MAX_TURNS:,}], got {self.turns}")
        if self.first_prompt.lo < 1:
            raise ValueError(f"first prompt length must be >= 1, got {self.first_prompt}")
        if self.output.lo < 1:
            raise ValueError(f"output length must be >= 1, got {self.output}")
        for k in ("first_prompt", "tool_result", "output"):
            if getattr(self, k).hi > MAX_REQUEST_TOKENS:
                raise ValueError(f"{k.replace('_', ' ')} length must be <= {MAX_REQUEST_TOKENS:,} tokens, "
                                 f"got {getattr(self, k)}")
        if not (math.isfinite(self.arrival_spread_s) and 0 <= self.arrival_spread_s <= MAX_GAP_S):
            raise ValueError(f"arrival spread must be in [0, {MAX_GAP_S:g}] seconds, got {self.arrival_spread_s!r}")
        if not (isinstance(self.vocab, int) and self.vocab >= 2):
            raise ValueError(f"vocab must be an integer >= 2, got {self.vocab!r}")

    def to_dict(self) -> dict:
        d = asdict(self)
        for k in ("turns", "first_prompt", "tool_result", "output"):
            d[k] = str(getattr(self, k))
        return d


def generate(spec: WorkloadSpec, seed: int = 0) -> Workload:
    """Draw a workload from ``spec``; the same (spec, seed) always gives the same workload."""
    if not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    rng = random.Random(f"kvgate-bench-workload:{seed}")
    width = len(str(spec.sessions - 1))
    sessions = []
    for i in range(spec.sessions):
        n_turns = spec.turns.sample(rng)
        start = rng.uniform(0.0, spec.arrival_spread_s) if spec.arrival_spread_s > 0 else 0.0
        turns = []
        for t in range(n_turns):
            new = spec.first_prompt.sample(rng) if t == 0 else spec.tool_result.sample(rng)
            gap = start if t == 0 else spec.tool.sample(rng)
            turns.append(TurnSpec(turn=t, new_tokens=new, output_tokens=spec.output.sample(rng), gap_s=gap))
        sessions.append(SessionSpec(session_id=f"s{seed}-{i:0{width}d}", turns=tuple(turns)))
    return Workload(sessions=tuple(sessions), seed=seed, vocab=spec.vocab, source="synthetic",
                    spec=spec.to_dict())


_TRACE_KEYS = ("session", "turn", "input_tokens", "output_tokens", "gap_s")


def load_trace(path: str | Path, *, seed: int = 0, vocab: int = VOCAB_DEFAULT) -> Workload:
    """Replay a JSONL trace: one ``{"session", "turn", "input_tokens", "output_tokens", "gap_s"}`` per line.

    ``input_tokens`` is the full prompt of that turn (history included); when it is at
    least the previous turn's prompt + output, the difference is the new tool result,
    otherwise the context was reset or truncated and the turn starts from fresh tokens.
    ``gap_s`` is the wait before the turn (for a session's first turn: its arrival offset).
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
        sessions.append(SessionSpec(session_id=sid, turns=tuple(turns)))
    return Workload(sessions=tuple(sessions), seed=seed, vocab=vocab, source=f"trace:{name}",
                    spec={"trace": name})


def session_tokens(workload: Workload, session_id: str, segment: int, n: int) -> list[int]:
    """Deterministic token ids for segment ``segment`` (a turn index) of a session."""
    if n <= 0:
        return []
    key = hashlib.blake2b(f"{workload.seed}|{session_id}|{segment}".encode(), digest_size=8).digest()
    rng = random.Random(int.from_bytes(key, "little"))
    raw = array("I")
    raw.frombytes(rng.randbytes(4 * n))
    v = workload.vocab
    # Ids 0..9 are left out: engines give some low ids special meaning (bos/eos/pad).
    return [10 + (x % (v - 10)) for x in raw] if v > 20 else [x % v for x in raw]
