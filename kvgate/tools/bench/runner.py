"""One step of one policy: every session of a workload against fresh engines, with the
gate or the cap around each turn, and what the step measured (:class:`PolicyResult`).

Every policy gets a fresh engine set (the simulator is restarted, or real engines have
their prefix caches reset) and a fresh gate name, and sees the same sessions and tokens.
"""
from __future__ import annotations

import asyncio
import contextlib
import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from .engines import Counters, EngineClient
# _start_poller, _stop_poller: tests/test_poller.py drives the bench's poller start from here
from .gates import _start_poller, _stop_poller, gate_for, maybe_await  # noqa: F401
from .policies import Policy
from .workload import Workload, for_step, session_tokens, turn_tokens
from ..._aio import wait_for

__all__ = ["TurnRecord", "PolicyResult", "run_policy", "default_step_timeout"]

#: what the default step timeout allows each turn (real seconds: the engine's time, any wait
#: for a gate or a cap), and what it adds on top (docs/benchmarks.md#step-timeout)
STEP_TIMEOUT_PER_TURN_S = 10.0
STEP_TIMEOUT_MARGIN_S = 600.0


def default_step_timeout(workload: Workload, time_scale: float) -> float:
    """A bound on one policy's step that only a stuck run reaches: every session's gaps (tool
    calls, arrival offsets) added up as if the sessions ran one after another (a cap of 1
    nearly does), times the time scale; plus 10 s per turn, unscaled, for the engine's time
    and any wait for a gate or a cap; plus 10 minutes. It grows with the workload, so a long
    trace replayed at scale 1 can finish; ``--step-timeout`` overrides it."""
    gaps = sum(t.gap_s for s in workload.sessions for t in s.turns)
    return STEP_TIMEOUT_MARGIN_S + time_scale * gaps + STEP_TIMEOUT_PER_TURN_S * workload.num_turns


@dataclass
class TurnRecord:
    session: str
    turn: int  # index within the session (0-based)
    ready_s: float  # when the turn was ready (after the tool), since the step started
    start_s: float  # when the engine call started (after any gate wait)
    done_s: float
    prompt_tokens: int
    cached_tokens: int | None
    output_tokens: int
    outcome: str = ""
    reason: str = ""
    waited_s: float = 0.0

    @property
    def latency_s(self) -> float:
        return self.done_s - self.ready_s


@dataclass
class PolicyResult:
    policy: Policy
    wall_s: float
    turns: list[TurnRecord]
    counters: Counters  # engine counters over this policy's run
    samples: list[tuple[float, float, float]]  # (t, cumulative hits, cumulative queries)
    usage_samples: list[tuple[float, float]]  # (t, worst engine usage)
    step_metrics: dict = field(default_factory=dict)
    errors: int = 0
    error_examples: list[str] = field(default_factory=list)
    gate_config: dict = field(default_factory=dict)
    gate_samples: list[dict] = field(default_factory=list)  # (t, reserved, ceiling, windows, waiting, usage)
    loop_lags: list[float] = field(default_factory=list)  # event-loop lateness samples, s (real time)
    # each rollout step's wall-clock, in order (``steps``); every other figure is the last step's
    step_walls: list[float] = field(default_factory=list)


def _error_text(e: BaseException) -> str:
    """``Type: message`` plus, for an HTTP error, the start of the response body: an engine
    says why it refused a request there (a token id outside the vocabulary, a prompt longer
    than the context), and the status line alone does not."""
    text = f"{type(e).__name__}: {e}".split("\nFor more information", 1)[0]
    resp = getattr(e, "response", None)
    if resp is not None:
        try:
            body = resp.text.strip()
        except Exception:  # a streamed or undecodable body: the status line is what there is
            body = ""
        if body:
            text += f" -- body: {body[:200]}"
    return text


async def run_policy(policy: Policy, workload: Workload, client: EngineClient, *,
                     time_scale: float, redis_url: str | None = None, base_cfg: Any = None,
                     scale_knobs: bool = True, snapshot_interval_s: float = 0.1,
                     sample_interval_s: float = 0.25, use_poller: bool = True,
                     on_turn: Callable[[TurnRecord], None] | None = None,
                     step_timeout_s: float | None = None, steps: int = 1) -> PolicyResult:
    """Run every session of ``workload`` against ``client`` under ``policy``; a step that
    outlasts ``step_timeout_s`` (default: :func:`default_step_timeout`) raises TimeoutError.

    ``steps`` runs that many rollout steps back to back, as a trainer does: one gate and its
    poller throughout (what the budget learned carries over), the engines' prefix caches reset
    between steps (a weight update does that), and each step's sessions new
    (:func:`~kvgate.tools.bench.workload.for_step`). The result is the last step's, with every
    step's wall-clock in ``step_walls``."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    if not (math.isfinite(time_scale) and time_scale > 0):
        raise ValueError(f"time scale must be > 0, got {time_scale!r}")
    if step_timeout_s is None:
        step_timeout_s = default_step_timeout(workload, time_scale)
    if not (math.isfinite(step_timeout_s) and step_timeout_s > 0):
        raise ValueError(f"step timeout must be a finite number of seconds > 0, got {step_timeout_s!r}")
    if policy.kind == "gate" and redis_url is None:
        raise ValueError(f"policy {policy.name!r} needs a Redis URL")
    loop = asyncio.get_running_loop()
    records: list[TurnRecord] = []
    errors: list[str] = []
    samples: list[tuple[float, float, float]] = []
    usage_samples: list[tuple[float, float]] = []

    # Warm the connection pool and the engine's code paths with one tiny request (tokens no
    # session uses), so the first policy does not pay start-up costs the others do not.
    with contextlib.suppress(Exception):
        await client.generate("kvgate-bench-warmup", [1 + (i % 7) for i in range(8)], 1)
    base = await client.counters()
    t0 = loop.time()

    gate_samples: list[dict] = []

    stop_sampling = asyncio.Event()

    async def sampler(gate) -> None:
        # stops on the event, not only on cancel: a cancel that lands while an awaited call
        # completes can be lost (see kvgate/_aio.py), and the run would never end
        while not stop_sampling.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await wait_for(stop_sampling.wait(), sample_interval_s)
            if stop_sampling.is_set():
                break
            c = await client.counters() - base
            samples.append((loop.time() - t0, c.hits, c.queries))
            with contextlib.suppress(Exception):
                us = [u["usage"] for u in await client.usage() if u["usage"] is not None]
                if us:
                    usage_samples.append((loop.time() - t0, max(us)))
            if gate is not None:
                with contextlib.suppress(Exception):
                    st = await maybe_await(gate.status())
                    gate_samples.append({"t": round(loop.time() - t0, 3), "reserved": st.get("reserved"),
                                         "ceiling": st.get("ceiling"), "windows": st.get("windows"),
                                         "leases": st.get("leases"), "waiting": st.get("waiting"),
                                         "usage": st.get("usage"),
                                         "prefill_s_per_token": st.get("prefill_s_per_token"),
                                         "prefill_load": st.get("prefill_load"),
                                         "tool_gap_s": st.get("tool_gap_s")})

    sem = asyncio.Semaphore(policy.cap) if policy.kind in ("cap", "turncap") else None

    async def session_body(sess, gate, first_ready: float | None = None) -> None:
        # first_ready: when the first turn was ready, if the session waited for it before
        # this body ran (a cap's slot), so that wait counts in the turn's latency
        history: list[int] = []
        sid = sess.session_id
        # what the session's prompts share with others, told to the gate (until a reset)
        levels = workload.shared_prefix(sess) if policy.share_prefix else ()
        shared = {"prefix_key": [k for k, _ in levels], "prefix_tokens": [t for _, t in levels]} if levels else {}
        try:
            for idx, t in enumerate(sess.turns):
                if t.gap_s > 0:
                    await asyncio.sleep(t.gap_s * time_scale)
                if t.reset_to is not None:
                    history = turn_tokens(workload, sess, idx)
                    shared = {}
                else:
                    history.extend(turn_tokens(workload, sess, idx))
                ready = loop.time() - t0 if idx or first_ready is None else first_ready
                outcome = reason = ""
                waited = 0.0
                try:
                    if gate is not None:
                        async with gate.turn(sid, prompt_ids=history, max_new_tokens=t.output_tokens,
                                             turn_index=idx, **shared) as lease:
                            start = loop.time() - t0
                            res = await client.generate(sid, history, t.output_tokens)
                            outcome = str(getattr(lease, "outcome", "") or "")
                            reason = str(getattr(lease, "reason", "") or "")
                            waited = float(getattr(lease, "waited_s", 0.0) or 0.0)
                    elif policy.kind == "turncap":
                        async with sem:
                            start = loop.time() - t0
                            res = await client.generate(sid, history, t.output_tokens)
                    else:
                        start = loop.time() - t0
                        res = await client.generate(sid, history, t.output_tokens)
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # count, keep the session going with a synthetic output
                    errors.append(f"{sid} turn {idx}: {_error_text(e)}"[:500])
                    history.extend(session_tokens(workload, sid, 100000 + idx, t.output_tokens))
                    continue
                done = loop.time() - t0
                rec = TurnRecord(session=sid, turn=idx, ready_s=ready, start_s=start, done_s=done,
                                 prompt_tokens=res.prompt_tokens or len(history),
                                 cached_tokens=res.cached_tokens, output_tokens=len(res.output_ids),
                                 outcome=outcome, reason=reason, waited_s=waited)
                records.append(rec)
                if on_turn is not None:
                    on_turn(rec)
                out = res.output_ids
                if len(out) < t.output_tokens and not out:
                    out = session_tokens(workload, sid, 100000 + idx, t.output_tokens)
                history.extend(out)
        finally:
            if gate is not None:
                with contextlib.suppress(Exception):
                    await gate.finish_session(sid)

    async def session(sess, gate) -> None:
        if policy.kind == "cap":
            start = sess.turns[0].gap_s if sess.turns else 0.0
            if start > 0:
                await asyncio.sleep(start * time_scale)
            arrived = loop.time() - t0
            async with sem:
                await session_body(replace(sess, turns=(replace(sess.turns[0], gap_s=0.0),) + sess.turns[1:]),
                                   gate, first_ready=arrived)
        else:
            await session_body(sess, gate)

    loop_lags: list[float] = []

    async def lag_probe() -> None:
        # how late the bench's event loop wakes a 10 ms sleep: every turn, wait and sample
        # shares this loop, and at time scale s a late wake-up is 1/s times longer in model
        # time, so a CPU-starved bench distorts what it measures (report.lag_warnings)
        while not stop_sampling.is_set():
            due = loop.time() + 0.01
            await asyncio.sleep(0.01)
            loop_lags.append(max(0.0, loop.time() - due))

    async def drive(gate, workload: Workload) -> float:
        nonlocal t0
        t0 = loop.time()
        samp = asyncio.create_task(sampler(gate))
        lag = asyncio.create_task(lag_probe())
        try:
            try:
                await wait_for(asyncio.gather(*(session(s, gate) for s in workload.sessions)),
                               timeout=step_timeout_s)
            except asyncio.TimeoutError:
                raise TimeoutError(f"policy {policy.name}: the step did not end within its timeout of "
                                   f"{step_timeout_s:,.1f} s (--step-timeout)") from None
            end = loop.time()
        finally:
            stop_sampling.set()
            samp.cancel()
            lag.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await wait_for(samp, 10.0)
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await wait_for(lag, 10.0)
        # the step's wall-clock runs from the first arrival (a trace may start every session
        # late) to the last session's end, not to the sampler's shutdown
        first = min((s.turns[0].gap_s for s in workload.sessions if s.turns), default=0.0)
        return end - t0 - first * time_scale

    async def drive_steps(gate) -> list[float]:
        nonlocal base
        walls = []
        for k in range(steps):
            if k:
                # a new step: the engines forget the last one's prefixes, and what this
                # result reports starts over (the last step's figures, every step's wall;
                # the failed turns of every step, which did less work than the workload asks)
                await client.reset_prefix_cache()
                for series in (records, samples, usage_samples, gate_samples, loop_lags):
                    series.clear()
                stop_sampling.clear()
                base = await client.counters()
            walls.append(await drive(gate, for_step(workload, k)))
        return walls

    step: dict = {}
    gate_info: dict = {}
    if policy.kind == "gate":
        async with gate_for(policy, redis_url, base_cfg, client, time_scale, scale_knobs,
                             snapshot_interval_s, use_poller) as (gate, gate_info):
            with contextlib.suppress(Exception):
                await maybe_await(gate.step_metrics(drain=True))  # start the step clean
            walls = await drive_steps(gate)
            with contextlib.suppress(Exception):
                step = dict(await maybe_await(gate.step_metrics(drain=True)))
    else:
        walls = await drive_steps(None)
    wall = walls[-1]
    final = await client.counters() - base
    samples.append((loop.time() - t0, final.hits, final.queries))
    return PolicyResult(policy=policy, wall_s=wall, turns=records, counters=final, samples=samples,
                        usage_samples=usage_samples, step_metrics=step, errors=len(errors),
                        error_examples=errors[:5], gate_config=gate_info, gate_samples=gate_samples,
                        loop_lags=loop_lags, step_walls=walls)
