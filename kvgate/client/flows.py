"""The pure core of a turn's admission: what to call next, how to decode it, when to
wait, when to give up. No I/O here; the sync ``Gate`` and the ``AsyncGate`` drive the same
generator (the httpx ``auth_flow`` idea), so the logic is written once.

The generator yields operations and receives their results:

- ``Eval(script, params)`` -> the script's decoded JSON reply; on a Redis fault the driver
  throws ``RedisDown`` into the generator instead.
- ``Probe()`` -> a ``ProbeResult`` (the driver turns errors and timeouts into UNAVAILABLE).
- ``Wait(timeout_s)`` -> "signal" (a pub/sub message for this ticket), "timeout" or "abort".

It returns a ``Decision`` or raises ``Preempted`` / ``AdmissionCancelled`` /
``AdmissionTimeout``.
"""
from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Generator, Sequence

from ..config import GateConfig
from ..errors import AdmissionCancelled, AdmissionTimeout, Preempted, ScriptError
from .probe import ProbeResult


class RedisDown(Exception):
    """Thrown into a flow when Redis could not answer (fault, timeout, breaker open)."""


class BreakerOpen(RedisDown):
    """RedisDown raised before anything was sent (the breaker is open after a recent fault),
    so the script certainly did not run."""


@dataclass(frozen=True)
class Eval:
    script: str
    params: dict


@dataclass(frozen=True)
class Probe:
    pass


@dataclass(frozen=True)
class Wait:
    timeout_s: float


@dataclass(frozen=True)
class TurnRequest:
    session_id: str
    ticket: str
    need: int
    prompt_tokens: int
    prompt_ids: Sequence[int] | None
    protected: bool = False
    retain: bool = True
    scope: str = "train"
    turn_index: int | None = None
    timeout_s: float | None = None
    gap_s: float | None = None   # the session's time away since its last turn ended (this process saw it)


@dataclass(frozen=True)
class Decision:
    outcome: str            # "admit" | "bypass" | "pass"
    reason: str             # see docs/concepts.md (empty for "pass")
    waited_s: float = 0.0
    tokens: int = 0
    epoch: int = -1
    held: bool = False      # True when Redis holds a lease that must be released


#: the most tokens a turn's prompt or decode budget may claim: far above any model's
#: context, and low enough that the ledger's sums stay exact in the scripts (Lua's ``%d``
#: and cjson's 14 significant digits)
MAX_TURN_TOKENS = 2**31 - 1


def new_ticket() -> str:
    return uuid.uuid4().hex


def check_session_id(session_id: Any) -> str:
    """A session id the scripts can carry: a non-empty str of at most 512 characters that
    encodes as UTF-8 (a lone surrogate would make every script call for it fail)."""
    if not isinstance(session_id, str) or not session_id or len(session_id) > 512:
        raise ValueError(f"session_id must be a non-empty string of at most 512 characters, got {session_id!r}")
    try:
        session_id.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"session_id must be valid Unicode (no lone surrogates), got {session_id!r}") from None
    return session_id


def build_request(cfg: GateConfig, session_id: Any, *, prompt_ids: Sequence[int] | None = None,
                  prompt_tokens: int | None = None, max_new_tokens: Any = None, protected: bool = False,
                  scope: str = "train", retain_session: bool = True, turn_index: int | None = None,
                  timeout_s: float | None = None, ticket: str | None = None) -> TurnRequest:
    """Validate a turn's arguments (before anything touches Redis) and size its reservation."""
    check_session_id(session_id)
    if (prompt_ids is None) == (prompt_tokens is None):
        raise ValueError("give exactly one of prompt_ids (token ids) or prompt_tokens (a count)")
    if prompt_ids is not None:
        if isinstance(prompt_ids, (str, bytes)) or not hasattr(prompt_ids, "__len__"):
            raise ValueError(f"prompt_ids must be a sequence of token ids, got {type(prompt_ids).__name__}")
        n_prompt = len(prompt_ids)
    else:
        if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int) or prompt_tokens < 0:
            raise ValueError(f"prompt_tokens must be an int >= 0, got {prompt_tokens!r}")
        n_prompt = prompt_tokens
    if n_prompt > MAX_TURN_TOKENS:
        raise ValueError(f"a prompt of {n_prompt} tokens is more than a turn may claim ({MAX_TURN_TOKENS})")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if max_new_tokens > MAX_TURN_TOKENS:
        raise ValueError(f"max_new_tokens={max_new_tokens} is more than a turn may claim ({MAX_TURN_TOKENS})")
    if scope not in ("train", "eval"):
        raise ValueError(f"scope must be 'train' or 'eval', got {scope!r}")
    if turn_index is not None and (isinstance(turn_index, bool) or not isinstance(turn_index, int) or turn_index < 0):
        raise ValueError(f"turn_index must be an int >= 0, got {turn_index!r}")
    if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                  or not math.isfinite(timeout_s) or timeout_s < 0):
        raise ValueError(f"timeout_s must be a finite number >= 0, got {timeout_s!r}")
    decode = max_new_tokens
    cap = cfg.effective("expected_decode_cap")  # never an unchecked cap (admission off)
    if cap is not None:
        decode = min(decode, cap)
    return TurnRequest(session_id=session_id, ticket=ticket or new_ticket(), need=n_prompt + decode,
                       prompt_tokens=n_prompt, prompt_ids=prompt_ids, protected=bool(protected),
                       retain=bool(retain_session), scope=scope, turn_index=turn_index, timeout_s=timeout_s)


def knob_params(cfg: GateConfig, channel: str) -> dict:
    """The knobs every script reads (see lua/includes/state.lua). A feature's knobs are the
    values the gate uses (``GateConfig.effective``): never an unchecked one of a feature that
    is off, which the scripts may still read (the ceiling's headroom) or JSON cannot carry."""
    wait_ms = int(cfg.wait_poll_s * 1000)
    eff = cfg.effective
    return {
        "adm": 1 if cfg.admission else 0, "res": 1 if cfg.residency else 0,
        "hw": eff("high_watermark"), "pt": eff("pressure_threshold"), "hit": eff("hit_threshold"),
        "headroom": eff("headroom"), "stale_ms": int(cfg.staleness_s * 1000),
        "ttl_ms": int(cfg.lease_ttl_s * 1000), "grace_ms": int(cfg.idle_grace_s * 1000),
        # a waiter re-checks at least every wait_poll_s: two missed polls mean it is gone
        "alive_ms": 2 * wait_ms + 1000, "claim_ms": 2 * wait_ms + 1000,
        "max_wait_ms": int(cfg.max_wait_s * 1000), "max_wait_hard_ms": int(cfg.max_wait_hard_s * 1000),
        "budget_scale": cfg.budget_scale if cfg.budget_scale is not None else -1,
        "reap": cfg.reap_batch, "ch": channel,
    }


def passes_through(cfg: GateConfig, req: TurnRequest) -> bool:
    """Rule 1: no gating feature on, or the turn is outside the gate's scope."""
    return not cfg.gating or (cfg.scope == "train" and req.scope != "train")


def acquire_flow(cfg: GateConfig, req: TurnRequest, knobs: dict, has_probe: bool,
                 clock: Callable[[], float]) -> Generator[Any, Any, Decision]:
    if passes_through(cfg, req):
        return Decision("pass", "")
    start = clock()
    # the scripts age the FIFO head by the Redis clock; this local bound is the safety net
    # that keeps "no wait past max_wait_hard_s + one poll" even if that clock misbehaves
    hard_deadline = start + cfg.max_wait_hard_s + cfg.wait_poll_s
    no_probe = -2
    params = dict(knobs, ticket=req.ticket, session=req.session_id, need=req.need,
                  protected=1 if req.protected else 0, retain=1 if req.retain else 0,
                  probe=-1 if (cfg.residency and has_probe) else no_probe)
    if req.gap_s is not None:
        params["gap"] = round(req.gap_s * 1000.0, 1)
    probe_default = params["probe"]

    def degraded() -> Decision:
        return Decision("bypass", "protected" if req.protected else "degraded", clock() - start)

    try:
        r = yield Eval("acquire", params)
    except RedisDown:
        return degraded()
    params.pop("gap", None)  # one sample per attempt: re-checks do not report it again
    while True:
        o = r.get("o")
        if o == "admit":
            return Decision("admit", r["r"], float(r.get("w", 0)) / 1000.0, int(r.get("t", 0)),
                            int(r.get("ep", -1)), held=True)
        if o == "bypass":
            return Decision("bypass", r["r"], float(r.get("w", 0)) / 1000.0, 0, int(r.get("ep", -1)))
        if o == "preempted":
            raise Preempted(req.session_id, req.ticket, r.get("r", "preempted"))
        if o == "probe":
            if "b" in r and "t0" not in params:
                params["t0"] = r["b"]  # when this attempt began (by the scripts' clock)
            result: ProbeResult = yield Probe()
            params["probe"] = result.hit_ratio if result.hit_ratio is not None else no_probe
        elif o == "wait":
            now = clock()
            if now >= hard_deadline:
                if params.get("age") != 1:
                    # this process's clock says the wait is over while the script's (Redis
                    # time, from the enqueue) does not yet: ask the script to age it now, so
                    # an aged turn is decided there like any other (lease and window, or bypass)
                    params["age"] = 1
                    try:
                        r = yield Eval("acquire", params)
                    except RedisDown:
                        return degraded()
                    continue
                yield from _cancel(req, aged=True)
                return Decision("bypass", "aged", now - start, epoch=0)
            if req.timeout_s is not None and now - start >= req.timeout_s:
                yield from _cancel(req)
                raise AdmissionTimeout(f"turn of session {req.session_id!r} waited {now - start:.3f}s "
                                       f"(timeout_s={req.timeout_s})")
            # re-check every poll: the head may age (no progress for max_wait_s) at any time
            timeout = min(cfg.wait_poll_s, max(0.0, hard_deadline - now) + 0.01)
            if req.timeout_s is not None:
                timeout = min(timeout, max(0.0, req.timeout_s - (now - start)) + 0.001)
            ev = yield Wait(timeout)
            if ev == "abort":
                yield from _cancel(req)
                raise AdmissionCancelled(f"turn of session {req.session_id!r} was aborted while waiting")
            params["probe"] = probe_default
        else:
            raise ScriptError(f"acquire.lua returned an unknown outcome: {r!r}")
        try:
            r = yield Eval("acquire", params)
        except RedisDown:
            return degraded()
        params["probe"] = probe_default


def _cancel(req: TurnRequest, aged: bool = False) -> Generator[Any, Any, None]:
    try:
        yield Eval("cancel", {"ticket": req.ticket, "aged": 1 if aged else 0})
    except RedisDown:
        pass  # its waiter record dies by liveness, a racing grant by its claim deadline
