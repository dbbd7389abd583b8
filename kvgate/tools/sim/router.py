"""Router simulator: the parts of sgl-router (sgl-model-gateway) kvgate talks to.

* ``GET /workers``: ``{"workers": [{"id", "url", "model_id", "worker_type",
  "is_healthy", "load", ...}], "total", "stats"}`` (disable with
  ``workers_endpoint=False`` to look like an older router: 404).
* ``GET /list_workers``: ``{"urls": [...]}``.
* ``POST /generate``: proxied to a healthy worker, sticky by ``session_id``
  (rendezvous hashing, so a worker going down moves only its own sessions) or
  the least loaded one when there is no session id.
* ``/close_session`` is **not** proxied (404), like the real router.
* Simulator admin: ``POST /sim/workers/health {"url", "healthy"}`` marks a worker.

A background health check (``GET /health`` on each worker every
``health_check_interval_s``) marks unreachable workers unhealthy and healthy
again when they answer; a worker marked unhealthy by the admin stays unhealthy
until marked healthy.  A connection error while proxying marks the worker
unhealthy and retries once on another worker.  A read timeout (the worker is
slow, not down) answers 504 and neither marks the worker nor retries.  A client
that disconnects while its request is proxied closes the upstream connection, so
the engine aborts the request (its own disconnect check).
"""
from __future__ import annotations

import asyncio
import hashlib
from typing import Dict, List, Optional, Sequence

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..._http import async_client
from .client import HttpPool as _Pool
from .http import _loads, error, json_response, wait_or_disconnect


class Worker:
    __slots__ = ("url", "model_id", "admin_healthy", "probe_healthy", "load", "requests", "pool")

    def __init__(self, url: str, model_id: str, timeout_s: float = 600.0) -> None:
        self.pool = _Pool(url, timeout_s)
        self.url = url.rstrip("/")
        self.model_id = model_id
        self.admin_healthy = True
        self.probe_healthy = True
        self.load = 0
        self.requests = 0

    @property
    def healthy(self) -> bool:
        return self.admin_healthy and self.probe_healthy


def _hrw(session_id: str, url: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{session_id}\x00{url}".encode(),
                                          digest_size=8).digest(), "big")


class SimRouter:
    def __init__(self, worker_urls: Sequence[str], *, model_id: str = "sim/model",
                 workers_endpoint: bool = True, health_check_interval_s: Optional[float] = 1.0,
                 request_timeout_s: float = 600.0) -> None:
        if not worker_urls:
            raise ValueError("the router needs at least one worker URL")
        self.workers: Dict[str, Worker] = {}
        for u in worker_urls:
            w = Worker(u, model_id, request_timeout_s)
            self.workers[w.url] = w
        self.workers_endpoint = workers_endpoint
        self.health_check_interval_s = health_check_interval_s
        self.request_timeout_s = request_timeout_s
        self._client: Optional[httpx.AsyncClient] = None
        self._health_task: Optional[asyncio.Task] = None

    # ----------------------------------------------------------- lifecycle
    async def start(self) -> None:
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
        self._client = async_client(timeout=httpx.Timeout(self.request_timeout_s, connect=2.0),
                                         limits=limits, trust_env=False)
        if self.health_check_interval_s:
            self._health_task = asyncio.create_task(self._health_loop())

    async def stop(self) -> None:
        if self._health_task:
            self._health_task.cancel()
            try:
                await self._health_task
            except (asyncio.CancelledError, Exception):
                pass
            self._health_task = None
        if self._client:
            await self._client.aclose()
            self._client = None
        for w in self.workers.values():
            w.pool.close()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_check_interval_s)
            await self.check_health()

    async def check_health(self) -> None:
        async def one(w: Worker) -> None:
            try:
                r = await self._client.get(w.url + "/health", timeout=1.0)
                w.probe_healthy = r.status_code == 200
            except httpx.HTTPError:
                w.probe_healthy = False
        await asyncio.gather(*(one(w) for w in list(self.workers.values())))

    # -------------------------------------------------------------- admin
    def set_healthy(self, url: str, healthy: bool) -> None:
        w = self.workers.get(url.rstrip("/"))
        if w is None:
            raise ValueError(f"unknown worker {url!r}; known: {', '.join(self.workers)}")
        w.admin_healthy = bool(healthy)
        if healthy:
            w.probe_healthy = True

    def healthy_workers(self) -> List[Worker]:
        return [w for w in self.workers.values() if w.healthy]

    def pick(self, session_id: Optional[str], exclude: Sequence[str] = ()) -> Optional[Worker]:
        cands = [w for w in self.workers.values() if w.healthy and w.url not in exclude]
        if not cands:
            return None
        if session_id is not None:
            return max(cands, key=lambda w: _hrw(session_id, w.url))
        return min(cands, key=lambda w: w.load)

    def workers_body(self) -> dict:
        ws = list(self.workers.values())
        return {
            "workers": [{"id": w.url, "url": w.url, "model_id": w.model_id, "priority": 50,
                         "cost": 1.0, "worker_type": "regular", "is_healthy": w.healthy,
                         "load": w.load, "connection_mode": "http"} for w in ws],
            "total": len(ws),
            "stats": {"total_workers": len(ws), "healthy_workers": sum(w.healthy for w in ws),
                      "total_models": len({w.model_id for w in ws}),
                      "total_load": sum(w.load for w in ws),
                      "by_type": {"regular": len(ws), "prefill": 0, "decode": 0}},
        }

    # --------------------------------------------------------------- app
    def app(self) -> Starlette:
        async def workers(request: Request) -> Response:
            if not self.workers_endpoint:
                return Response("Not Found", status_code=404)
            return json_response(self.workers_body())

        async def list_workers(request: Request) -> Response:
            return json_response({"urls": list(self.workers)})

        async def health(request: Request) -> Response:
            return Response(status_code=200 if self.healthy_workers() else 503)

        async def set_health(request: Request) -> Response:
            try:
                data = _loads(await request.body())
                if not isinstance(data, dict) or not isinstance(data.get("url"), str) \
                        or not isinstance(data.get("healthy"), bool):
                    raise ValueError('body must be {"url": str, "healthy": bool}')
                self.set_healthy(data["url"], data["healthy"])
            except ValueError as e:
                return error(str(e))
            return json_response(self.workers_body())

        async def generate(request: Request) -> Response:
            body = await request.body()
            try:
                data = _loads(body)
                if not isinstance(data, dict):
                    raise ValueError("request body must be a JSON object")
            except ValueError as e:
                return json_response({"error": {"message": str(e), "code": 400}}, 400)
            sid = data.get("session_id")
            sid = sid if isinstance(sid, str) and sid else None
            tried: List[str] = []
            for _ in range(2):
                w = self.pick(sid, exclude=tried)
                if w is None:
                    break
                tried.append(w.url)
                w.load += 1
                w.requests += 1
                up = asyncio.ensure_future(w.pool.post("/generate", body))
                try:
                    if not await wait_or_disconnect(up, request):
                        # the client went away: drop the upstream request (closing its
                        # connection makes the engine abort it)
                        up.cancel()
                        try:
                            await up
                        except BaseException:
                            pass
                        return json_response({"error": {"message": "client disconnected",
                                                        "code": 499}}, 499)
                    status, ctype, content = up.result()
                except TimeoutError:
                    # a slow worker is not a dead one: no health mark, no retry (the request
                    # may still be running there)
                    return json_response({"error": {"message": f"worker {w.url} did not answer "
                                                    f"within {w.pool.timeout_s} s", "code": 504}}, 504)
                except ConnectionError:
                    w.probe_healthy = False
                    continue
                except asyncio.CancelledError:
                    up.cancel()
                    raise
                finally:
                    w.load -= 1
                return Response(content, status_code=status, media_type=ctype)
            return json_response({"error": {"message": "no healthy worker available",
                                            "code": 503}}, 503)

        routes = [
            Route("/workers", workers, methods=["GET"]),
            Route("/list_workers", list_workers, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/generate", generate, methods=["POST"]),
            Route("/sim/workers/health", set_health, methods=["POST"]),
        ]
        app = Starlette(routes=routes)
        app.state.router = self
        return app
