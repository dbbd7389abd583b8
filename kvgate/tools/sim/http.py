"""Starlette app that serves a :class:`SimEngine` with SGLang's HTTP surface.

Routes (SGLang's): ``POST /generate``, ``POST /abort_request``, ``GET|POST /open_session``,
``GET|POST /close_session``, ``GET|POST /flush_cache``, ``GET /health``, ``GET /health_generate``,
``GET /get_model_info``, ``GET /get_server_info``, ``GET /metrics``.
Routes a real SGLang does not have: ``POST /kvgate/probe`` and
``GET /kvgate/usage`` (the shared probe contract, so kvgate's HTTP probe can be
pointed at the simulator), ``GET /sim/stats`` and ``POST /sim/stop``.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Optional

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from ..._json import dumps as _dumps, loads as _loads
from .engine import SimEngine
from .scheduler import Req


#: How often (wall seconds) a waiting ``/generate`` checks whether its client went away.
#: SGLang's tokenizer manager wakes every ``SGLANG_REQUEST_STATE_WAIT_TIMEOUT`` (4 s) to
#: check ``request.is_disconnected()`` and aborts the request; the simulator checks sooner.
DISCONNECT_POLL_S = 1.0


async def wait_or_disconnect(fut: "asyncio.Future", request: Request,
                             period: Optional[float] = None) -> bool:
    """Wait for ``fut``; every ``period`` seconds check whether the client disconnected.

    True when ``fut`` is done, False when the client went away first (``fut`` is left alone)."""
    if period is None:
        period = DISCONNECT_POLL_S
    while True:
        done, _ = await asyncio.wait((fut,), timeout=period)
        if done:
            return True
        if await request.is_disconnected():
            return False


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(_dumps(obj), status_code=status, media_type="application/json")


def error(msg: str, status: int = 400) -> Response:
    return json_response({"error": msg}, status)


def sglang_error(msg: str, status: int = 400) -> Response:
    return json_response({"error": {"message": msg, "code": status}}, status)


async def read_json(request: Request, allow_empty: bool = False) -> Any:
    body = await request.body()
    if not body.strip():
        if allow_empty:
            return {}
        raise ValueError("request body is empty; expected a JSON object")
    try:
        data = _loads(body)
    except ValueError as e:
        raise ValueError(f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError("request body must be a JSON object")
    return data


def _session_id(data: dict) -> Optional[str]:
    sid = data.get("session_id")
    if sid is None:
        return None
    if not isinstance(sid, str) or not sid:
        raise ValueError("session_id must be a non-empty string")
    return sid


def build_engine_app(engine: SimEngine, on_stop: Optional[Callable[[], Any]] = None) -> Starlette:
    """The HTTP app of one engine.  ``on_stop`` is called by ``POST /sim/stop``."""

    async def generate(request: Request) -> Response:
        try:
            data = await read_json(request)
            if "input_ids" not in data:
                if "text" in data:
                    raise ValueError("the simulator has no tokenizer: send input_ids, not text")
                raise ValueError("input_ids is required")
            ids = data["input_ids"]
            if isinstance(ids, list) and ids and isinstance(ids[0], list):
                raise ValueError("batched input_ids (a list of lists) are not supported by the simulator")
            if data.get("stream"):
                raise ValueError("stream=true is not supported by the simulator")
            sp = data.get("sampling_params") or {}
            if not isinstance(sp, dict):
                raise ValueError("sampling_params must be a JSON object")
            max_new = sp.get("max_new_tokens")
            if max_new is None:
                max_new = 128            # SGLang's SamplingParams default
            rid = data.get("rid")
            if rid is not None and (not isinstance(rid, str) or not rid):
                raise ValueError("rid must be a non-empty string")
            sid = _session_id(data)
            loop = asyncio.get_running_loop()
            fut: asyncio.Future = loop.create_future()

            def done(r: Req) -> None:
                if not fut.done():
                    fut.set_result(r)

            t0 = time.perf_counter()
            r = engine.submit(ids, max_new, rid=rid, session_id=sid, on_done=done)
        except ValueError as e:
            return sglang_error(str(e), 400)
        except RuntimeError as e:
            return sglang_error(str(e), 503)
        try:
            finished = await wait_or_disconnect(fut, request)
        except asyncio.CancelledError:
            engine.abort(r.rid)
            raise
        if not finished:
            # the client went away: abort, as SGLang's tokenizer manager does (nobody reads this)
            engine.abort(r.rid)
            return sglang_error("Request is disconnected from the client side. "
                                f"Abort request {r.rid}", 400)
        fr = r.finish_reason
        if fr.get("type") == "abort" and fr.get("message") == "engine stopped":
            return sglang_error("engine stopped", 503)
        code = fr.get("status_code") if fr.get("type") == "abort" else None
        if isinstance(code, int) and 400 <= code < 600:
            # SGLang's _handle_abort_finish_reason: a 400 abort is a ValueError -> error body,
            # any other status an HTTPException (FastAPI's {"detail": ...})
            if code == 400:
                return sglang_error(str(fr.get("message")), 400)
            return json_response({"detail": fr.get("message")}, code)
        meta = {
            "id": r.rid,
            "finish_reason": fr,
            "prompt_tokens": r.prompt_len,
            "completion_tokens": len(r.output_ids),
            "cached_tokens": r.cached_tokens,
            "e2e_latency": time.perf_counter() - t0,
            "sim_engine_latency": r.t_done - r.t_submit,
            "sim_retractions": r.retractions,
        }
        return json_response({"text": "", "output_ids": r.output_ids, "meta_info": meta})

    async def abort_request(request: Request) -> Response:
        try:
            data = await read_json(request)
            if data.get("abort_all"):
                engine.abort_all()
                return Response(status_code=200)
            rid = data.get("rid")
            if not isinstance(rid, str) or not rid:
                raise ValueError("rid must be a non-empty string (or abort_all: true)")
        except ValueError as e:
            return error(str(e))
        engine.abort_request(rid)
        return Response(status_code=200)

    async def open_session(request: Request) -> Response:
        try:
            data = await read_json(request)
            cap = data.get("capacity_of_str_len")
            if isinstance(cap, bool) or not isinstance(cap, int):
                # a required field of SGLang's OpenSessionReqInput (unused by the simulator)
                raise ValueError("capacity_of_str_len (an integer) is required")
            sid = _session_id(data)
            if data.get("streaming"):
                raise ValueError("Streaming sessions are disabled. "
                                 "Please relaunch with --enable-streaming-session.")
        except ValueError as e:
            return json_response({"error": {"message": str(e)}}, 400)
        sid = engine.open_session(sid)
        if sid is None:
            return json_response({"error": {"message": "Failed to open the session. Check if a "
                                            "session with the same id is still open."}}, 400)
        return json_response(sid)

    async def close_session(request: Request) -> Response:
        try:
            data = await read_json(request)
            sid = _session_id(data)
            if sid is None:
                raise ValueError("session_id is required")
        except ValueError as e:
            return error(str(e))
        engine.close_session(sid)
        return Response(status_code=200)

    async def flush_cache(request: Request) -> Response:
        ok = engine.flush_cache()
        msg = ("Cache flushed.\nPlease check backend logs for more details. (When there are "
               "running or waiting requests, the operation will not be performed.)\n")
        return PlainTextResponse(msg if ok else msg.replace("Cache flushed.", "Cache not flushed."),
                                 status_code=200 if ok else 400)

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def model_info(request: Request) -> Response:
        return json_response({"model_path": engine.model_name, "tokenizer_path": None,
                              "is_generation": True, "preferred_sampling_params": None,
                              "weight_version": "default", "simulator": True})

    async def server_info(request: Request) -> Response:
        # SGLang: server args + the scheduler's get_init_info() (max_total_num_tokens,
        # ...) at the top level; internal_states[i] per DP rank, with the
        # pool size as memory_usage.token_capacity
        p = engine.profile
        return json_response({
            "model_path": engine.model_name, "tp_size": engine.tp_size, "dp_size": engine.dp_size,
            "page_size": p.block_size, "context_length": p.max_context,
            "max_running_requests": p.max_running_requests,
            "max_prefill_tokens": p.max_prefill_tokens,
            "enable_session_radix_cache": engine.session_radix_cache,
            "radix_eviction_policy": "priority" if engine.session_radix_cache else "lru",
            "status": "ready",
            "max_total_num_tokens": engine.ranks[0].cache.capacity_tokens,
            "internal_states": [{"dp_rank": i, "page_size": p.block_size,
                                 "memory_usage": {"token_capacity": r.cache.capacity_tokens,
                                                  "token_capacity_swa": None}}
                                for i, r in enumerate(engine.ranks)],
            "version": "kvgate-sim", "simulator": True, "profile": p.name,
            "time_scale": engine.time_scale})

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(engine.metrics_text(),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    async def kv_probe(request: Request) -> Response:
        try:
            data = await read_json(request)
            ids = data.get("prompt_ids")
            if not isinstance(ids, list) or (ids and set(map(type, ids)) != {int}):
                raise ValueError("prompt_ids must be a list of integers")
            sid = _session_id(data)
        except ValueError as e:
            return error(str(e))
        return json_response(engine.probe(ids, session_id=sid))

    async def kv_usage(request: Request) -> Response:
        return json_response(engine.usage())

    async def sim_stats(request: Request) -> Response:
        return json_response(engine.stats())

    async def sim_stop(request: Request) -> Response:
        if on_stop is None:
            return error("this engine has no stop hook", 404)
        asyncio.get_running_loop().call_soon(on_stop)
        return Response(status_code=200)

    routes = [
        Route("/generate", generate, methods=["POST"]),
        Route("/abort_request", abort_request, methods=["POST"]),
        Route("/open_session", open_session, methods=["GET", "POST"]),
        Route("/close_session", close_session, methods=["GET", "POST"]),
        Route("/flush_cache", flush_cache, methods=["GET", "POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/health_generate", health, methods=["GET"]),
        Route("/get_model_info", model_info, methods=["GET"]),
        Route("/model_info", model_info, methods=["GET"]),
        Route("/get_server_info", server_info, methods=["GET"]),
        Route("/server_info", server_info, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/kvgate/probe", kv_probe, methods=["POST"]),
        Route("/kvgate/usage", kv_usage, methods=["GET"]),
        Route("/sim/stats", sim_stats, methods=["GET"]),
        Route("/sim/stop", sim_stop, methods=["POST"]),
    ]
    app = Starlette(routes=routes)
    app.state.engine = engine
    return app
