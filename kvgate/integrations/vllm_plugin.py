"""vLLM plugin: residency probe and usage as EngineCore utility methods, plus HTTP routes.

Two entry points (declared in kvgate's pyproject; select them with ``VLLM_PLUGINS=kvgate``):

- ``vllm.general_plugins: kvgate = kvgate.integrations.vllm_plugin:register`` runs in every vLLM process
  (API server, EngineCore, workers) and adds two methods to the ``EngineCore`` class:

  * ``kvgate_usage()`` -> ``{"usage", "num_gpu_blocks", "num_free_blocks", "block_size", ...}``
  * ``kvgate_probe(prompt_ids, cache_salt=None)`` -> how many LEADING full blocks of the prompt are in the
    prefix cache right now: ``{"cached_blocks", "cached_tokens", "total_blocks", "total_tokens",
    "hit_ratio", "block_size", "engine"}``.

  Clients reach them as ``EngineCoreRequestType.UTILITY`` calls (``engine_core.call_utility_async(
  "kvgate_probe", ids)``); EngineCore runs utility calls on its main thread between engine steps, so a
  probe never enters the scheduler queue and never races the scheduler.

- ``vllm.endpoint_plugins: kvgate = kvgate.integrations.vllm_plugin:register_routes`` is a zero-argument
  factory (vLLM's ``EndpointPlugin`` protocol) whose ``attach_router(app)`` adds ``POST /kvgate/probe`` and
  ``GET /kvgate/usage`` to the OpenAI server.  ``register_routes(app)`` with an app attaches directly.

The probe is read-only: it hashes the prompt with the engine's own ``request_block_hasher`` (same hash
function, same ``NONE_HASH`` seed, same extra keys) on a throw-away ``Request`` object that is never added
to the scheduler, and looks the hashes up with ``kv_cache_manager.coordinator.find_longest_cache_hit``,
which only reads ``BlockPool.cached_block_hash_to_block``: no block is allocated, touched (LRU order is
unchanged) or freed, and no prefix-cache statistic is recorded (``get_computed_blocks`` is avoided).
Hashing stops at the first missing block (hashes are chained, so nothing after a miss can hit).
"""
from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from kvgate.integrations._common import PROBE_METHOD, USAGE_METHOD, check_prompt_ids, check_session_id
from kvgate._aio import wait_for

logger = logging.getLogger("kvgate.vllm_plugin")

PLUGIN_NAME = "kvgate"
PROBE_PATH = "/kvgate/probe"
USAGE_PATH = "/kvgate/usage"
#: server-side bound on one utility call (the EngineCore answers between steps; a long prefill step delays it)
SERVER_TIMEOUT_ENV = "KVGATE_VLLM_ROUTE_TIMEOUT_S"
#: when set, the routes require `Authorization: Bearer <token>` (vLLM's --api-key guards /v1 paths only)
TOKEN_ENV = "KVGATE_VLLM_ROUTE_TOKEN"
_FIRST_CHUNK_BLOCKS = 8


# --------------------------------------------------------------------------------------------- engine side
def _block_size(core: Any) -> int:
    kvm = getattr(core.scheduler, "kv_cache_manager", None)
    coord = getattr(kvm, "coordinator", None)
    bs = getattr(coord, "scheduler_block_size", None)
    if not bs:
        bs = core.vllm_config.cache_config.block_size
    return int(bs)


def _engine_id(core: Any) -> str:
    try:
        rank = int(core.vllm_config.parallel_config.data_parallel_rank)
    except Exception:  # noqa: BLE001
        rank = 0
    return f"dp{rank}"


def kvgate_usage(self) -> dict:
    """Cheap usage read (EngineCore utility method)."""
    kvm = getattr(self.scheduler, "kv_cache_manager", None)
    pool = getattr(kvm, "block_pool", None)
    out: dict[str, Any] = {"engine": _engine_id(self), "block_size": _block_size(self)}
    if pool is None:
        out.update(usage=0.0, num_gpu_blocks=0, num_free_blocks=0)
        return out
    out["usage"] = float(pool.get_usage())
    out["num_gpu_blocks"] = int(pool.num_gpu_blocks)
    out["num_free_blocks"] = int(pool.get_num_free_blocks())
    try:
        out["num_cached_blocks"] = len(pool.cached_block_hash_to_block)
    except Exception:  # noqa: BLE001
        pass
    running = getattr(self.scheduler, "running", None)
    waiting = getattr(self.scheduler, "waiting", None)
    if running is not None:
        out["num_running_reqs"] = len(running)
    if waiting is not None:
        out["num_waiting_reqs"] = len(waiting)
    return out


def _hit_tokens(kvm: Any, hashes: list, max_len: int, block_size: int) -> int:
    """Leading cached tokens for `hashes` (hash-block granularity), read-only."""
    try:
        res = kvm.coordinator.find_longest_cache_hit(list(hashes), max_len)
        return int(res[1])  # (blocks, hit_len) or (blocks, hit_len, uncached) depending on version
    except (AttributeError, TypeError, IndexError):
        # fallback for versions without that coordinator signature: walk full blocks by hand
        pool = kvm.block_pool
        if getattr(pool, "hash_block_size", block_size) != block_size:
            raise
        groups = list(range(len(kvm.kv_cache_config.kv_cache_groups)))
        n = 0
        for h in hashes[: max_len // block_size]:
            if not pool.get_cached_block(h, groups):
                break
            n += 1
        return n * block_size


def leading_hit(lookup: Any, extend: Any, total_tokens: int, first_chunk: int, block_size: int) -> int:
    """Leading cached tokens of a prompt of ``total_tokens`` (whole blocks), looked up in growing
    chunks (``first_chunk``, then doubling): ``lookup(upto)`` is the engine's hit over the first
    ``upto`` tokens, ``extend(a, b)`` hashes tokens ``a:b`` onto the lookup's blocks. Stops at the
    first chunk that is not fully cached, so a cold prompt costs one small chunk, not the whole
    prompt. One block of slack: with EAGLE/MTP speculative decoding vLLM drops the last matched
    block of every lookup (``drop_eagle_block``), so a fully cached chunk reads one block short."""
    upto = first_chunk
    while True:
        hit = lookup(upto)
        if hit + block_size < upto or upto >= total_tokens:
            return hit
        nxt = min(total_tokens, upto * 2)
        extend(upto, nxt)
        upto = nxt


def kvgate_probe(self, prompt_ids: Any, cache_salt: Any = None) -> dict:
    """Leading full blocks of `prompt_ids` present in the prefix cache (EngineCore utility method)."""
    ids = check_prompt_ids(prompt_ids)
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise ValueError("cache_salt must be a str or None")
    bs = _block_size(self)
    n = len(ids)
    total_blocks = n // bs
    out = {"cached_blocks": 0, "cached_tokens": 0, "total_blocks": total_blocks, "total_tokens": n,
           "hit_ratio": 0.0, "block_size": bs, "engine": _engine_id(self)}
    kvm = getattr(self.scheduler, "kv_cache_manager", None)
    hasher = getattr(self, "request_block_hasher", None)
    if kvm is None or hasher is None or not getattr(kvm, "enable_caching", True):
        # no prefix cache to ask: "unavailable" (SPEC rule 8 fails open), not "cold"
        raise RuntimeError("prefix caching is off in this engine (--enable-prefix-caching)")
    if total_blocks == 0:
        return out

    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    chunk = min(total_blocks, _FIRST_CHUNK_BLOCKS) * bs
    req = Request("kvgate-probe", ids[:chunk], sampling_params=SamplingParams(max_tokens=1),
                  pooling_params=None, block_hasher=hasher, cache_salt=cache_salt)
    hit = leading_hit(lambda upto: _hit_tokens(kvm, req.block_hashes, upto, bs),
                      lambda a, b: req.append_output_token_ids(ids[a:b]),  # extends block_hashes
                      total_blocks * bs, chunk, bs)
    cached_blocks = min(hit // bs, total_blocks)
    out["cached_blocks"] = cached_blocks
    out["cached_tokens"] = cached_blocks * bs
    out["hit_ratio"] = out["cached_tokens"] / n
    return out


def register() -> None:
    """`vllm.general_plugins` entry point: add the utility methods to EngineCore (idempotent)."""
    try:
        from vllm.v1.engine.core import EngineCore
    except Exception as e:  # noqa: BLE001 - never break vLLM start-up
        logger.warning("kvgate: vLLM EngineCore not importable, probe methods not installed: %s", e)
        return
    if getattr(EngineCore, "_kvgate_installed", False):
        return
    EngineCore.kvgate_usage = kvgate_usage
    EngineCore.kvgate_probe = kvgate_probe
    EngineCore._kvgate_installed = True
    logger.debug("kvgate: installed EngineCore.%s / .%s", PROBE_METHOD, USAGE_METHOD)


# ------------------------------------------------------------------------------------------- client side
def engine_client_cores(engine_core_client: Any) -> int:
    engines = getattr(engine_core_client, "core_engines", None)
    return len(engines) if engines else 1


async def call_all_engines(engine_core_client: Any, method: str, *args: Any) -> list:
    """Call a utility method on every EngineCore behind an async engine-core client.

    With data parallel (several EngineCores) vLLM's ``call_utility_all_async`` asks each of them
    concurrently; with one engine, ``call_utility_async``.
    """
    if engine_client_cores(engine_core_client) > 1 and hasattr(engine_core_client, "call_utility_all_async"):
        return list(await engine_core_client.call_utility_all_async(method, *args))
    return [await engine_core_client.call_utility_async(method, *args)]


def best_probe_answer(answers: list[dict]) -> dict:
    """Data parallel: the engine holding the most leading blocks answers (the router picks the engine;
    prefix-aware routers send the session where its prefix lives)."""
    return max(answers, key=lambda a: a.get("cached_tokens", 0))


def merge_usage(answers: list[dict]) -> dict:
    """Data parallel usage: the worst engine (max usage), as kvgate aggregates everywhere."""
    worst = dict(max(answers, key=lambda a: a.get("usage", 0.0)))
    if len(answers) > 1:
        worst["engines"] = answers
    return worst


class KvgateEndpointPlugin:
    """vLLM `EndpointPlugin`: adds `POST /kvgate/probe` and `GET /kvgate/usage`."""

    name = PLUGIN_NAME
    required_tasks = ("generate",)

    def __init__(self, timeout_s: float | None = None, token: str | None = None):
        if timeout_s is None:
            raw = os.environ.get(SERVER_TIMEOUT_ENV, "5.0")
            try:
                timeout_s = _route_timeout(float(raw))
            except ValueError:  # never break the API server's start-up over it: say so, use 5 s
                logger.warning("kvgate: %s=%r is not a number of seconds in (0, 3600]; using 5.0",
                               SERVER_TIMEOUT_ENV, raw)
                timeout_s = 5.0
        self.timeout_s = _route_timeout(timeout_s)
        self.token = token if token is not None else (os.environ.get(TOKEN_ENV) or None)

    def attach_router(self, app: Any) -> None:
        attach_routes(app, timeout_s=self.timeout_s, token=self.token)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        state.kvgate_engine_client = engine_client


def _route_timeout(v: Any) -> float:
    """The routes' bound on an engine's answer: a finite number of seconds in (0, 3600]."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v <= 3600):
        raise ValueError(f"route timeout must be a number of seconds in (0, 3600], got {v!r}")
    return float(v)


def _engine_core_of(app: Any) -> Any:
    state = app.state
    client = getattr(state, "kvgate_engine_client", None) or getattr(state, "engine_client", None)
    return getattr(client, "engine_core", None) if client is not None else None


def attach_routes(app: Any, timeout_s: float = 5.0, token: str | None = None) -> None:
    """Add the two routes to a FastAPI/Starlette app whose state holds vLLM's `engine_client`."""
    import hmac

    from starlette.requests import Request as HTTPRequest
    from starlette.responses import JSONResponse

    def err(status: int, msg: str) -> JSONResponse:
        return JSONResponse({"error": msg}, status_code=status)

    def denied(request: HTTPRequest) -> bool:
        if not token:
            return False
        got = request.headers.get("authorization", "")
        return not hmac.compare_digest(got.encode(), f"Bearer {token}".encode())

    async def probe(request: HTTPRequest) -> JSONResponse:
        if denied(request):
            return err(401, "unauthorized")
        try:
            body = await request.json()
        except Exception:  # noqa: BLE001
            return err(400, "body must be JSON")
        if not isinstance(body, dict):
            return err(400, "body must be a JSON object")
        if "prompt_ids" not in body:
            return err(400, "missing prompt_ids")
        try:
            ids = check_prompt_ids(body["prompt_ids"])
        except ValueError as e:
            return err(400, str(e))
        sid = body.get("session_id")
        if sid is not None:
            try:
                check_session_id(sid)
            except ValueError as e:
                return err(400, str(e))
        salt = body.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            return err(400, "cache_salt must be a string")
        core = _engine_core_of(request.app)
        if core is None:
            return err(503, "no engine behind this server")
        args = (ids,) if salt is None else (ids, salt)
        try:
            answers = await wait_for(call_all_engines(core, PROBE_METHOD, *args), timeout_s)
        except asyncio.TimeoutError:
            return err(504, f"engine did not answer within {timeout_s}s")
        except Exception as e:  # noqa: BLE001
            return err(500, f"probe failed (is VLLM_PLUGINS=kvgate loaded in the engine?): {e}")
        return JSONResponse(best_probe_answer(answers))

    async def usage(request: HTTPRequest) -> JSONResponse:
        if denied(request):
            return err(401, "unauthorized")
        core = _engine_core_of(request.app)
        if core is None:
            return err(503, "no engine behind this server")
        try:
            answers = await wait_for(call_all_engines(core, USAGE_METHOD), timeout_s)
        except asyncio.TimeoutError:
            return err(504, f"engine did not answer within {timeout_s}s")
        except Exception as e:  # noqa: BLE001
            return err(500, f"usage failed (is VLLM_PLUGINS=kvgate loaded in the engine?): {e}")
        return JSONResponse(merge_usage(answers))

    # plain Starlette routes (the handlers take the request): works on vLLM's FastAPI app and any Starlette app
    app.add_route(PROBE_PATH, probe, methods=["POST"], include_in_schema=False)
    app.add_route(USAGE_PATH, usage, methods=["GET"], include_in_schema=False)


def register_routes(app: Any = None) -> KvgateEndpointPlugin | None:
    """`vllm.endpoint_plugins` entry point.

    vLLM 0.32 calls it with no argument and expects an `EndpointPlugin` object (it then calls
    `attach_router(app)` and `init_state(engine_client, state, args)`).  Called with an app (own servers,
    older vLLM hooks) it attaches the routes directly.
    """
    if app is None:
        return KvgateEndpointPlugin()
    KvgateEndpointPlugin().attach_router(app)  # the token and timeout from the environment, as the plugin
    return None
