"""Drive one seeded workload through several admission policies, one after another.

Policies:

* ``none``       every turn goes straight to the engines;
* ``cap-N``      a fixed per-session cap: at most N sessions are active (between their
                 first turn and their end) at once; others wait FIFO to start.  This is the
                 naive alternative kvgate is measured against; the bench sweeps a few N;
* ``turncap-N``  at most N turns in flight at once (optional; a per-request cap);
* ``admission``  kvgate with ``GateConfig(admission=True, residency=False)``;
* ``residency``  kvgate with ``GateConfig(admission=False, residency=True)`` and the HTTP probe;
* ``kvgate``     both features, default knobs, HTTP probe.

Every policy gets a fresh engine set (the simulator is restarted, or real engines have
their prefix caches reset) and a fresh gate name, and sees the same sessions and tokens.
"""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import re
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Callable, Sequence

from .engines import Counters, EngineClient
from .workload import Workload, session_tokens
from ..._aio import wait_for

__all__ = ["Policy", "parse_policies", "TurnRecord", "PolicyResult", "EngineEnv", "run_policy",
           "scaled_gate_config", "GATE_POLICIES", "default_step_timeout"]

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

GATE_POLICIES = {
    "admission": (True, False),
    "residency": (False, True),
    "kvgate": (True, True),
}


@dataclass(frozen=True)
class Policy:
    name: str
    kind: str  # none | cap | turncap | gate
    cap: int | None = None
    admission: bool = False
    residency: bool = False
    knobs: tuple = ()  # (name, value) GateConfig overrides of this policy only


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets: ``none,kvgate[max_wait_s=600,headroom=0.8]``."""
    items, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in policies {text!r}")
        if ch == "," and depth == 0:
            items.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise ValueError(f"unbalanced '[' in policies {text!r}")
    items.append("".join(cur))
    return items


def _policy_knobs(name: str, body: str) -> tuple:
    from kvgate.config import parse_value

    out = []
    for item in body.split(","):
        k, sep, v = item.partition("=")
        k = k.strip()
        if not sep or not k:
            raise ValueError(f"bad policy {name!r}: expected NAME=VALUE inside [...], got {item.strip()!r}")
        if k in ("admission", "residency"):
            raise ValueError(f"bad policy {name!r}: unknown knob {k!r} (admission and residency are set by "
                             f"the policy's base name)")
        try:
            out.append((k, parse_value(k, v)))
        except ValueError as e:
            raise ValueError(f"bad policy {name!r}: {e}") from None
    return tuple(out)


def parse_policies(text: str | Sequence[str], caps: Sequence[int]) -> list[Policy]:
    """``none,cap,admission,residency,kvgate`` -> policies; ``cap`` expands to one per cap.

    A gate policy may carry its own knobs: ``kvgate[max_wait_s=600,idle_grace_s=120]`` runs
    the full gate with those two knobs changed (in unscaled seconds, like ``--knob``), so
    several settings can be compared side by side in one run."""
    items = _split_top(text) if isinstance(text, str) else list(text)
    out: list[Policy] = []
    for raw in items:
        name = raw.strip()
        if not name:
            continue
        if "[" in name:
            base, _, rest = name.partition("[")
            if not rest.endswith("]") or base.strip() not in GATE_POLICIES:
                raise ValueError(f"bad policy {name!r}: knobs in [...] follow a gate policy "
                                 f"(admission, residency, kvgate) and close the name")
            adm, res = GATE_POLICIES[base.strip()]
            out.append(Policy(name, "gate", admission=adm, residency=res,
                              knobs=_policy_knobs(name, rest[:-1])))
            continue
        if name == "none":
            out.append(Policy("none", "none"))
        elif name in ("cap", "turncap"):
            if not caps:
                raise ValueError(f"policy {name!r} needs at least one cap (--caps)")
            out.extend(Policy(f"{name}-{c}", name, cap=c) for c in caps)
        elif name.startswith("cap-") or name.startswith("turncap-"):
            kind, _, n = name.partition("-")
            try:
                c = int(n)
            except ValueError:
                raise ValueError(f"bad policy {name!r}: expected {kind}-N with an integer N") from None
            if c < 1:
                raise ValueError(f"bad policy {name!r}: the cap must be >= 1")
            out.append(Policy(name, kind, cap=c))
        elif name in GATE_POLICIES:
            adm, res = GATE_POLICIES[name]
            out.append(Policy(name, "gate", admission=adm, residency=res))
        else:
            raise ValueError(f"unknown policy {name!r}: use none, cap, cap-N, turncap-N, "
                             f"admission, residency, kvgate")
    if not out:
        raise ValueError("no policies given")
    names = [p.name for p in out]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ValueError(f"policy given twice: {', '.join(sorted(dup))}")
    return out


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


class EngineEnv:
    """A fresh set of engines for one policy: ``async with env.fresh() as client``."""

    def fresh(self) -> contextlib.AbstractAsyncContextManager[EngineClient]:  # pragma: no cover
        raise NotImplementedError

    def describe(self) -> dict:
        return {}


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


def scaled_gate_config(base: Any, policy: Policy, time_scale: float, scale_knobs: bool = True) -> Any:
    """Per-policy GateConfig: features from the policy, time knobs scaled with the workload.

    The workload's tool latencies and the engines' costs are multiplied by ``time_scale``;
    so are the gate's own durations (idle grace, max wait, wait poll), keeping every ratio
    the same as in an unscaled run.  ``staleness_s`` and ``lease_ttl_s`` are safety
    timeouts, not dynamics, and stay as they are.
    """
    if policy.knobs:
        try:
            base = replace(base, **dict(policy.knobs))
        except TypeError as e:
            raise ValueError(f"policy {policy.name!r}: {e}") from None
    kw = {"admission": policy.admission, "residency": policy.residency}
    if scale_knobs and time_scale != 1.0:
        for k in ("idle_grace_s", "max_wait_s", "max_wait_hard_s", "wait_poll_s"):
            v = getattr(base, k, None)
            if v is not None:
                kw[k] = max(v * time_scale, 0.01) if v > 0 else v
    return replace(base, **kw)


async def _maybe(x: Any) -> Any:
    return await x if inspect.isawaitable(x) else x


class _SnapshotFeeder:
    """Writes capacity snapshots into the gate from ``GET /kvgate/usage`` of each engine.

    Used when ``kvgate.control.poller.Poller`` is not available (or not wanted); also runs the
    gate's housekeeping each tick, as the poller would.
    """

    def __init__(self, gate: Any, client: EngineClient, interval_s: float) -> None:
        self.gate, self.client, self.interval_s = gate, client, interval_s

    async def tick(self) -> None:
        import kvgate

        states = []
        for u in await self.client.usage():
            cap = u["capacity_tokens"]
            usage = u["usage"]
            states.append(kvgate.EngineState(
                engine_id=u["url"], capacity_tokens=cap,
                used_tokens=int(round((usage or 0.0) * cap)), usage=usage,
                healthy=bool(u["healthy"]), url=u["url"], kind=self.client.kind))
        await _maybe(self.gate.write_snapshot(states))
        with contextlib.suppress(Exception):
            await _maybe(self.gate.housekeep(limit=100))

    async def run(self) -> None:
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # the gate fails open on a stale snapshot; keep trying
                pass
            await asyncio.sleep(self.interval_s)


def _make_probe(client: EngineClient, timeout_s: float) -> Any:
    """The vLLM helper's HTTP probe against the engines' ``POST /kvgate/probe`` (None if absent)."""
    try:
        from kvgate.integrations.http_probe import HttpProbe
    except ImportError:
        return None
    return HttpProbe(list(client.engine_urls), timeout_s=timeout_s)


@contextlib.asynccontextmanager
async def _gate_for(policy: Policy, redis_url: str, base_cfg: Any, client: EngineClient,
                    time_scale: float, scale_knobs: bool, snapshot_interval_s: float,
                    use_poller: bool) -> AsyncIterator[tuple[Any, dict]]:
    import kvgate

    cfg = scaled_gate_config(base_cfg, policy, time_scale, scale_knobs)
    probe = _make_probe(client, getattr(cfg, "probe_timeout_s", 0.5)) if policy.residency else None
    safe = re.sub(r"[^A-Za-z0-9._:-]+", "_", policy.name).strip("_")[:80]
    name = f"bench-{safe}-{uuid.uuid4().hex[:8]}"
    gate = kvgate.AsyncGate.from_url(redis_url, gate=name, config=cfg, probe=probe)
    feeder_task = None
    poller = None
    try:
        if use_poller:
            poller = await _start_poller(redis_url, name, cfg, client, snapshot_interval_s)
        if poller is None:
            feeder = _SnapshotFeeder(gate, client, snapshot_interval_s)
            await feeder.tick()
            feeder_task = asyncio.create_task(feeder.run())
        info = {"gate": name, "config": _cfg_dict(cfg), "probe": type(probe).__name__ if probe else None,
                "snapshots": "kvgate.control.poller.Poller" if poller is not None else "bench feeder (/kvgate/usage)"}
        yield gate, info
    finally:
        if feeder_task is not None:
            feeder_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await feeder_task
        if poller is not None:
            with contextlib.suppress(Exception):
                await _stop_poller(poller)
        for closer in ("aclose", "close"):
            fn = getattr(gate, closer, None)
            if fn is not None:
                with contextlib.suppress(Exception):
                    await _maybe(fn())
                break
        if probe is not None:
            for closer in ("aclose", "close"):
                fn = getattr(probe, closer, None)
                if fn is not None:
                    with contextlib.suppress(Exception):
                        await _maybe(fn())
                    break


class _PollerHandle:
    def __init__(self, poller: Any, task: asyncio.Task, gate: Any) -> None:
        self.poller, self.task, self.gate = poller, task, gate

    async def aclose(self) -> None:
        self.poller.stop()
        try:
            await wait_for(self.task, 5.0)
        except (asyncio.TimeoutError, asyncio.CancelledError, Exception):
            self.task.cancel()
        with contextlib.suppress(Exception):
            self.gate.close()


async def _start_poller(redis_url: str, gate_name: str, cfg: Any, client: EngineClient,
                        interval_s: float) -> Any:
    """Run the real ``kvgate.control.poller.Poller`` (static engine list) as a task in this loop.

    Returns None when the poller is not importable, so the bench falls back to its own
    ``/kvgate/usage`` feeder.  The first tick runs before any turn and, where the engines
    export prefill time (vLLM), the poller keeps ticking until its first prefill-load window
    has closed (a few seconds at most): a deployed poller runs all along, so a rollout step
    never starts with the load unmeasured; without this every gate policy would spend its
    first seconds holding turns back on an idle engine (docs/benchmarks.md#poller-warm-up).
    """
    try:
        import kvgate
        from kvgate.control.poller import PREFILL_LOAD_WINDOW_S, Poller
    except ImportError:
        return None
    sync_gate = kvgate.Gate.from_url(redis_url, gate=gate_name, config=cfg)
    poller = Poller(sync_gate, engines=list(client.engine_urls), interval_s=interval_s,
                    leader_ttl_s=max(5.0, 10 * interval_s))
    first = await poller.atick()
    snap = getattr(first, "snapshot", None)
    # a poller writes an empty healthy set too (the epoch must see it); the bench's feeder
    # reads /kvgate/usage itself, so it takes over unless the poller saw a healthy engine
    if not getattr(first, "wrote", False) or snap is None or getattr(snap, "n_healthy", 0) == 0:
        poller.release()
        with contextlib.suppress(Exception):
            sync_gate.close()
        return None
    deadline = time.monotonic() + PREFILL_LOAD_WINDOW_S + 2 * interval_s
    while poller.prefill_load_pending and time.monotonic() < deadline:
        await asyncio.sleep(min(interval_s, max(0.0, deadline - time.monotonic())))
        await poller.atick()
    task = asyncio.create_task(poller.arun())
    return _PollerHandle(poller, task, sync_gate)


async def _stop_poller(p: Any) -> None:
    await p.aclose()


def _cfg_dict(cfg: Any) -> dict:
    try:
        from dataclasses import asdict
        return asdict(cfg)
    except TypeError:
        return dict(getattr(cfg, "__dict__", {}))


async def run_policy(policy: Policy, workload: Workload, client: EngineClient, *,
                     time_scale: float, redis_url: str | None = None, base_cfg: Any = None,
                     scale_knobs: bool = True, snapshot_interval_s: float = 0.1,
                     sample_interval_s: float = 0.25, use_poller: bool = True,
                     on_turn: Callable[[TurnRecord], None] | None = None,
                     step_timeout_s: float | None = None) -> PolicyResult:
    """Run every session of ``workload`` against ``client`` under ``policy``; a step that
    outlasts ``step_timeout_s`` (default: :func:`default_step_timeout`) raises TimeoutError."""
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
                    st = await _maybe(gate.status())
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
        try:
            for idx, t in enumerate(sess.turns):
                if t.gap_s > 0:
                    await asyncio.sleep(t.gap_s * time_scale)
                if t.reset_to is not None:
                    history = session_tokens(workload, sid, t.turn, t.reset_to)
                else:
                    history.extend(session_tokens(workload, sid, t.turn, t.new_tokens))
                ready = loop.time() - t0 if idx or first_ready is None else first_ready
                outcome = reason = ""
                waited = 0.0
                try:
                    if gate is not None:
                        async with gate.turn(sid, prompt_ids=history, max_new_tokens=t.output_tokens,
                                             turn_index=idx) as lease:
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

    async def drive(gate) -> float:
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

    step: dict = {}
    gate_info: dict = {}
    if policy.kind == "gate":
        async with _gate_for(policy, redis_url, base_cfg, client, time_scale, scale_knobs,
                             snapshot_interval_s, use_poller) as (gate, gate_info):
            with contextlib.suppress(Exception):
                await _maybe(gate.step_metrics(drain=True))  # start the step clean
            wall = await drive(gate)
            with contextlib.suppress(Exception):
                step = dict(await _maybe(gate.step_metrics(drain=True)))
    else:
        wall = await drive(None)
    final = await client.counters() - base
    samples.append((loop.time() - t0, final.hits, final.queries))
    return PolicyResult(policy=policy, wall_s=wall, turns=records, counters=final, samples=samples,
                        usage_samples=usage_samples, step_metrics=step, errors=len(errors),
                        error_examples=errors[:5], gate_config=gate_info, gate_samples=gate_samples,
                        loop_lags=loop_lags)
