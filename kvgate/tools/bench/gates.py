"""A gate for one gate policy's step: its GateConfig, residency probe and snapshot source.

Snapshots come from the real ``kvgate.control.poller.Poller`` (static engine list, a task in
the bench's event loop); where it cannot start, from the bench's own ``/kvgate/usage`` feeder.
"""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import re
import time
import uuid
from typing import Any, AsyncIterator

from .engines import EngineClient
from .policies import Policy, scaled_gate_config
from ..._aio import wait_for

__all__ = ["gate_for", "maybe_await"]


async def maybe_await(x: Any) -> Any:
    """``await x`` where x is awaitable (AsyncGate), else x (Gate)."""
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
        await maybe_await(self.gate.write_snapshot(states))
        with contextlib.suppress(Exception):
            await maybe_await(self.gate.housekeep(limit=100))

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
async def gate_for(policy: Policy, redis_url: str, base_cfg: Any, client: EngineClient,
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
        await _close(gate)
        if probe is not None:
            await _close(probe)


async def _close(obj: Any) -> None:
    """Close ``obj`` by its ``aclose()`` or else its ``close()`` (the gate and the probe have
    one or the other); a failure to close is not the step's."""
    fn = getattr(obj, "aclose", None) or getattr(obj, "close", None)
    if fn is not None:
        with contextlib.suppress(Exception):
            await maybe_await(fn())


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
    never starts with the engines unmeasured (docs/benchmarks.md#poller-warm-up).
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
