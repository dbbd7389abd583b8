"""Agentic rollout workloads: seeded synthetic sessions (JSONL trace replay: :mod:`.trace`).

A workload is a tuple of sessions; a session is a tuple of turns.  Every turn re-sends
the whole history (all previous prompts and outputs) plus the new tokens of this turn
(the first prompt for turn 0, the tool result afterwards), so prompts grow monotonically.
Before each turn the session waits ``gap_s`` seconds: for turn 0 that is its arrival
offset from the start of the step, afterwards the tool call's latency.  Times are stored
unscaled; the runner multiplies them by ``--time-scale``.

Token ids are derived from (seed, session id) alone, so the same workload sends the same
tokens to every policy and every run.  Shared prefixes are the exception, by design: the
first ``system_tokens`` of every first prompt are one system prompt, and the first
``shared_tokens`` of a grouped session's first prompt are its group's (GRPO-style: n samples
of one task send the same task prompt, then diverge), drawn from (seed, group) alone, so an
engine's prefix cache stores them once.  Outputs are whatever the engine returns
(``output_ids``); the runner appends them to the history, so the next turn's prompt is a
true extension of what the engine has cached.
"""
from __future__ import annotations

import hashlib
import math
import random
from array import array
from dataclasses import asdict, dataclass, field, replace
from typing import Sequence

__all__ = ["IntRange", "ToolLatency", "TurnSpec", "SessionSpec", "Workload", "WorkloadSpec", "generate", "for_step",
           "parse_range", "MAX_REQUEST_TOKENS", "MAX_GAP_S", "session_tokens", "turn_tokens"]

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
    """A session's turns; ``group`` names the task it samples (GRPO: the n samples of a task
    are a group), whose first ``shared_tokens`` tokens of the first prompt its siblings send
    too (the workload's system prompt included)."""

    session_id: str
    turns: tuple[TurnSpec, ...]
    group: str | None = None
    shared_tokens: int = 0

    @property
    def start_s(self) -> float:
        return self.turns[0].gap_s if self.turns else 0.0


@dataclass(frozen=True)
class Workload:
    """Sessions plus the seed that fixes their token ids; every session's first prompt starts
    with the same ``system_tokens`` (a system prompt and tool schema)."""

    sessions: tuple[SessionSpec, ...]
    seed: int = 0
    vocab: int = VOCAB_DEFAULT
    source: str = "synthetic"
    spec: dict = field(default_factory=dict)
    system_tokens: int = 0

    def shared_prefix(self, session: SessionSpec) -> tuple[tuple[str, int], ...]:
        """The prefixes a session's prompts share with other sessions, outermost first, as the
        gate is told them (``prefix_key``, ``prefix_tokens``): the system prompt, then its
        group's first prompt, which starts with it. Empty: none. Holds until the session's
        context is reset."""
        levels: list[tuple[str, int]] = []
        if self.system_tokens > 0:
            levels.append(("system", self.system_tokens))
        if session.group is not None and session.shared_tokens > self.system_tokens:
            levels.append((f"group:{session.group}", session.shared_tokens))
        return tuple(levels)

    def distinct_prompt_tokens(self) -> int:
        """Fresh prompt tokens (:meth:`fresh_tokens`) with each shared prefix counted once:
        a first prompt repeats its group's prompt when a sibling came before it, else the
        system prompt when any session came before it."""
        n = 0
        groups: set[str] = set()
        for k, s in enumerate(self.sessions):
            for i, t in enumerate(s.turns):
                new = t.reset_to if t.reset_to is not None else t.new_tokens
                if i == 0 and t.reset_to is None:
                    if s.group is not None and s.group in groups:
                        new -= min(s.shared_tokens, new)
                    elif k > 0:
                        new -= min(self.system_tokens, new)
                n += new
            if s.group is not None:
                groups.add(s.group)
        return n

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
    #: samples per task (GRPO's n): each run of ``group_size`` sessions is one task, whose
    #: first prompt (length drawn once per task) all its samples send; 1: no groups
    group_size: int = 1
    #: the leading tokens of every first prompt that are one system prompt (and tool schema)
    system_prompt: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.group_size, int) and 1 <= self.group_size <= MAX_SESSIONS):
            raise ValueError(f"group size must be an integer in [1, {MAX_SESSIONS:,}], got {self.group_size!r}")
        if not (isinstance(self.system_prompt, int) and 0 <= self.system_prompt <= self.first_prompt.lo):
            raise ValueError(f"system prompt must be an integer of tokens in [0, the shortest first prompt "
                             f"{self.first_prompt.lo}], got {self.system_prompt!r}")
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
        if self.group_size == 1 and self.system_prompt == 0:
            # the spec of a workload without sharing reads as it always did
            del d["group_size"], d["system_prompt"]
        return d


def generate(spec: WorkloadSpec, seed: int = 0) -> Workload:
    """Draw a workload from ``spec``; the same (spec, seed) always gives the same workload."""
    if not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    rng = random.Random(f"kvgate-bench-workload:{seed}")
    width = len(str(spec.sessions - 1))
    grouped = spec.group_size > 1
    gwidth = len(str((spec.sessions - 1) // spec.group_size))
    sessions = []
    task_prompt = start = 0.0
    for i in range(spec.sessions):
        n_turns = spec.turns.sample(rng)
        if not grouped or i % spec.group_size == 0:
            # a task's samples arrive together (a rollout sends the n samples of a task at once)
            start = rng.uniform(0.0, spec.arrival_spread_s) if spec.arrival_spread_s > 0 else 0.0
        turns = []
        for t in range(n_turns):
            if t == 0 and grouped and i % spec.group_size == 0:
                task_prompt = spec.first_prompt.sample(rng)
            if t == 0:
                new = task_prompt if grouped else spec.first_prompt.sample(rng)
            else:
                new = spec.tool_result.sample(rng)
            gap = start if t == 0 else spec.tool.sample(rng)
            turns.append(TurnSpec(turn=t, new_tokens=new, output_tokens=spec.output.sample(rng), gap_s=gap))
        group = f"t{seed}-{i // spec.group_size:0{gwidth}d}" if grouped else None
        sessions.append(SessionSpec(session_id=f"s{seed}-{i:0{width}d}", turns=tuple(turns), group=group,
                                    shared_tokens=int(task_prompt) if grouped else 0))
    return Workload(sessions=tuple(sessions), seed=seed, vocab=spec.vocab, source="synthetic",
                    spec=spec.to_dict(), system_tokens=spec.system_prompt)


def for_step(workload: Workload, step: int) -> Workload:
    """The workload as rollout step ``step`` (from 0) of a run sends it: step 0 as it is; a
    later step the same shapes under new session ids and new task groups (a trainer samples
    new rollouts of new tasks every step), so no token, session or prefix of an earlier step
    carries over. The system prompt is the same in every step."""
    if step == 0:
        return workload
    tag = f"~{step}"
    return replace(workload, sessions=tuple(
        replace(s, session_id=s.session_id + tag, group=None if s.group is None else s.group + tag)
        for s in workload.sessions))


def turn_tokens(workload: Workload, session: SessionSpec, index: int) -> list[int]:
    """The token ids turn ``index`` of ``session`` adds to its history (all of it after a
    reset). A first prompt starts with the workload's system prompt, then its group's
    prompt up to ``shared_tokens``, then the session's own tokens: shared parts are drawn
    from (seed, system) and (seed, group) alone, so siblings send identical ids and the
    engines' block hashes of them match."""
    t = session.turns[index]
    sid = session.session_id
    if t.reset_to is not None:
        return session_tokens(workload, sid, t.turn, t.reset_to)
    n = t.new_tokens
    if index > 0:
        return session_tokens(workload, sid, t.turn, n)
    sys_n = min(workload.system_tokens, n)
    shared = min(max(session.shared_tokens, sys_n), n) if session.group is not None else sys_n
    if shared == 0:
        return session_tokens(workload, sid, t.turn, n)
    ids = session_tokens(workload, "\x00system", 0, sys_n)
    if shared > sys_n:
        ids += session_tokens(workload, f"\x00group:{session.group}", 0, shared - sys_n)
    return ids + session_tokens(workload, sid, t.turn, n - shared)


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
