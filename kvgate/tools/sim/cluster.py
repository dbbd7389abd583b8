"""Run simulated engines + a router on loopback, in-process or in a child process.

In-process (default): one background thread runs an asyncio loop that hosts every
engine's scheduler tasks and every uvicorn server (each on its own free
127.0.0.1 port).  ``SimCluster`` is a context manager; start and stop are
bounded by ``start_timeout_s`` / ``stop_timeout_s``.

With ``process=True`` the same cluster runs in a child ``python -m kvgate.tools.sim``
(another core for the simulator; only the HTTP surface is available then, plus
``stop_engine`` through ``POST /sim/stop``).
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import TimeoutError as _FutTimeout
from typing import Any, Callable, Dict, List, Optional

import httpx
import uvicorn

from .engine import SimEngine
from .http import build_engine_app
from .profile import Profile, load_profile
from .router import SimRouter
from ..._aio import wait_for

LOOPBACK = "127.0.0.1"


def _bind(host: str, port: int) -> socket.socket:
    # proto=IPPROTO_TCP matters: asyncio only sets TCP_NODELAY on accepted sockets whose
    # proto is TCP; with proto 0 every response waits ~40 ms on Nagle + delayed ACK.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


class _Served:
    """One uvicorn server on a pre-bound socket, running as a task on the sim loop."""

    def __init__(self, app: Any, sock: socket.socket) -> None:
        self.sock = sock
        self.port = sock.getsockname()[1]
        cfg = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                             timeout_graceful_shutdown=2, http="h11", ws="none",
                             timeout_keep_alive=30, backlog=2048)
        self.server = uvicorn.Server(cfg)
        self.task: Optional[asyncio.Task] = None

    async def start(self, timeout: float) -> None:
        self.task = asyncio.create_task(self.server.serve(sockets=[self.sock]))
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if self.task.done():
                self.task.result()
                raise RuntimeError("uvicorn server exited during start-up")
            if time.monotonic() > deadline:
                raise TimeoutError("uvicorn server did not start in time")
            await asyncio.sleep(0.005)

    async def stop(self, timeout: float) -> None:
        self.server.should_exit = True
        if self.task is not None:
            try:
                await wait_for(asyncio.shield(self.task), timeout)
            except asyncio.TimeoutError:
                self.server.force_exit = True
                self.task.cancel()
            except Exception:
                pass
        try:
            self.sock.close()
        except OSError:
            pass


class SimCluster:
    """``n_engines`` simulated SGLang engines and (optionally) a router, on loopback.

    Attributes once started: ``engine_urls`` (list of base URLs), ``router_url``
    (None without a router), ``urls`` (router URL if any, else engine URLs),
    ``engines`` (the :class:`SimEngine` objects; in-process only; they live on the
    simulator thread: use :meth:`call` for consistent reads), ``router``.
    """

    def __init__(self, n_engines: int = 2, profile: Any = "gpu-h100-30b", *,
                 time_scale: float = 0.05, tp_size: int = 1, dp_size: int = 1,
                 session_radix_cache: bool = False, router: bool = True,
                 workers_endpoint: bool = True, health_check_interval_s: Optional[float] = 1.0,
                 host: str = LOOPBACK, base_port: int = 0, router_port: Optional[int] = None,
                 advertise_host: Optional[str] = None, process: bool = False,
                 start_timeout_s: float = 20.0, prefill_metrics: bool = False,
                 stop_timeout_s: float = 10.0, **profile_overrides: Any) -> None:
        if isinstance(n_engines, bool) or not isinstance(n_engines, int) or n_engines < 1:
            raise ValueError(f"n_engines must be an integer >= 1, got {n_engines!r}")
        self.profile: Profile = load_profile(profile, **profile_overrides)
        self.n_engines = n_engines
        self.engine_kwargs = dict(time_scale=time_scale, tp_size=tp_size, dp_size=dp_size,
                                  session_radix_cache=session_radix_cache, prefill_metrics=prefill_metrics)
        SimEngine(self.profile, **self.engine_kwargs)  # validate arguments early
        self.with_router = router
        self.workers_endpoint = workers_endpoint
        self.health_check_interval_s = health_check_interval_s
        self.host = host
        # the host name put in URLs (engine_urls, the router's /workers); binding 0.0.0.0
        # or a container name needs another name here
        self.advertise_host = advertise_host or host
        self.base_port = base_port
        self.router_port = router_port
        self.process = process
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.engine_urls: List[str] = []
        self.router_url: Optional[str] = None
        self.engines: List[SimEngine] = []
        self.router: Optional[SimRouter] = None
        self._servers: List[Optional[_Served]] = []
        self._router_server: Optional[_Served] = None
        self._bg_tasks: set = set()   # tasks started by POST /sim/stop, held until done
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._proc: Optional[subprocess.Popen] = None
        self._tmpdir: Optional[str] = None
        self.running = False

    # ------------------------------------------------------------ helpers
    @property
    def urls(self) -> List[str]:
        return [self.router_url] if self.router_url else list(self.engine_urls)

    def _port_for(self, i: int) -> int:
        return self.base_port + i if self.base_port else 0

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float = 10.0) -> Any:
        """Run ``fn(*args)`` (sync or async) on the simulator loop and return its result."""
        if self._loop is None:
            raise RuntimeError("call() needs an in-process cluster that is running")

        async def run() -> Any:
            res = fn(*args)
            if asyncio.iscoroutine(res):
                res = await res
            return res

        fut = asyncio.run_coroutine_threadsafe(run(), self._loop)
        try:
            return fut.result(timeout)
        except _FutTimeout:
            fut.cancel()
            raise TimeoutError(f"simulator call did not finish within {timeout} s") from None

    def stats(self, i: int) -> Dict[str, Any]:
        """Engine ``i``'s counters and pool state (same body as ``GET /sim/stats``)."""
        if self.process:
            return httpx.get(self.engine_urls[i] + "/sim/stats", timeout=5.0,
                             trust_env=False).json()
        return self.call(self.engines[i].stats)

    # ---------------------------------------------------------- lifecycle
    def __enter__(self) -> "SimCluster":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> "SimCluster":
        if self.running:
            return self
        if self.process:
            self._start_process()
        else:
            self._start_thread()
        self.running = True
        return self

    def _start_thread(self) -> None:
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            ready.set()
            try:
                loop.run_forever()
            finally:
                try:
                    loop.run_until_complete(loop.shutdown_asyncgens())
                except Exception:
                    pass
                loop.close()

        self._thread = threading.Thread(target=run, name="kvgate-sim", daemon=True)
        self._thread.start()
        if not ready.wait(self.start_timeout_s):
            raise TimeoutError("simulator thread did not start")
        try:
            self.call(self._astart, timeout=self.start_timeout_s)
        except BaseException:
            self.stop()
            raise

    async def _astart(self) -> None:
        self._servers = [None] * self.n_engines
        self.engines = [None] * self.n_engines  # type: ignore[list-item]
        self.engine_urls = [""] * self.n_engines
        for i in range(self.n_engines):
            await self._astart_engine(i, self._port_for(i))
        if self.with_router:
            self.router = SimRouter(self.engine_urls, model_id=self.profile.model_name,
                                    workers_endpoint=self.workers_endpoint,
                                    health_check_interval_s=self.health_check_interval_s)
            await self.router.start()
            port = self.router_port if self.router_port is not None else (
                self.base_port + self.n_engines if self.base_port else 0)
            srv = _Served(self.router.app(), _bind(self.host, port))
            await srv.start(self.start_timeout_s)
            self._router_server = srv
            self.router_url = f"http://{self.advertise_host}:{srv.port}"

    async def _astart_engine(self, i: int, port: int) -> None:
        eng = SimEngine(self.profile, engine_id=f"sim-{i}", **self.engine_kwargs)
        await eng.start()
        loop = asyncio.get_running_loop()

        def on_stop() -> None:
            # keep a reference until the task is done: the loop holds tasks only weakly
            task = loop.create_task(self._astop_engine(i))
            self._bg_tasks.add(task)
            task.add_done_callback(self._bg_tasks.discard)

        app = build_engine_app(eng, on_stop=on_stop)
        srv = _Served(app, _bind(self.host, port))
        await srv.start(self.start_timeout_s)
        url = f"http://{self.advertise_host}:{srv.port}"
        eng.engine_id = url
        self.engines[i] = eng
        self._servers[i] = srv
        self.engine_urls[i] = url

    async def _astop_engine(self, i: int) -> None:
        srv, eng = self._servers[i], self.engines[i]
        self._servers[i] = None
        if eng is not None:
            await eng.stop()
        if srv is not None:
            await srv.stop(self.stop_timeout_s / 2)

    def stop_engine(self, i: int) -> None:
        """Take engine ``i`` down (its port refuses connections; pending requests get 503)."""
        if not 0 <= i < self.n_engines:
            raise ValueError(f"engine index {i} out of range 0..{self.n_engines - 1}")
        if self.process:
            try:
                httpx.post(self.engine_urls[i] + "/sim/stop", timeout=5.0, trust_env=False)
            except httpx.HTTPError:
                pass
            deadline = time.monotonic() + self.stop_timeout_s
            while time.monotonic() < deadline:
                try:
                    httpx.get(self.engine_urls[i] + "/health", timeout=0.5, trust_env=False)
                except httpx.HTTPError:
                    return
                time.sleep(0.05)
            raise TimeoutError(f"engine {i} did not stop")
        self.call(self._astop_engine, i, timeout=self.stop_timeout_s)

    def start_engine(self, i: int) -> None:
        """Restart a stopped engine on its old port with an empty cache (in-process only)."""
        if self.process:
            raise RuntimeError("start_engine is only available in-process")
        if self._servers[i] is not None:
            raise RuntimeError(f"engine {i} is running")
        port = int(self.engine_urls[i].rsplit(":", 1)[1])
        self.call(self._astart_engine, i, port, timeout=self.start_timeout_s)

    def set_worker_healthy(self, i: int, healthy: bool) -> None:
        """Mark engine ``i`` healthy/unhealthy in the router (``/workers`` shows it)."""
        if self.router_url is None:
            raise RuntimeError("this cluster has no router")
        r = httpx.post(self.router_url + "/sim/workers/health",
                       json={"url": self.engine_urls[i], "healthy": healthy}, timeout=5.0,
                       trust_env=False)
        r.raise_for_status()

    async def _astop_all(self) -> None:
        # fail pending engine requests first (503s), so the router drains at once
        for eng in self.engines:
            if eng is not None and not eng.stopped:
                await eng.stop()
        if self._router_server is not None:
            await self._router_server.stop(self.stop_timeout_s / 3)
            self._router_server = None
        if self.router is not None:
            await self.router.stop()
        for i in range(len(self._servers)):
            await self._astop_engine(i)

    def stop(self) -> None:
        if self.process:
            self._stop_process()
            self.running = False
            return
        loop, th = self._loop, self._thread
        if loop is not None and th is not None and th.is_alive():
            try:
                self.call(self._astop_all, timeout=self.stop_timeout_s)
            except Exception:
                pass
            loop.call_soon_threadsafe(loop.stop)
            th.join(self.stop_timeout_s)
        self._loop = None
        self._thread = None
        self.running = False

    # ---------------------------------------------------------- process mode
    def _start_process(self) -> None:
        self._tmpdir = tempfile.mkdtemp(prefix="kvgate-sim-")
        ready = os.path.join(self._tmpdir, "ready.json")
        prof = os.path.join(self._tmpdir, "profile.json")
        with open(prof, "w", encoding="utf-8") as f:
            json.dump(self.profile.to_dict(), f)
        cmd = [sys.executable, "-m", "kvgate.tools.sim", "--engines", str(self.n_engines),
               "--profile", prof, "--time-scale", str(self.engine_kwargs["time_scale"]),
               "--tp-size", str(self.engine_kwargs["tp_size"]),
               "--dp-size", str(self.engine_kwargs["dp_size"]),
               "--host", self.host, "--advertise-host", self.advertise_host,
               "--port", str(self.base_port), "--ready-file", ready]
        if self.router_port is not None:
            cmd += ["--router-port", str(self.router_port)]
        if self.engine_kwargs["session_radix_cache"]:
            cmd.append("--enable-session-radix-cache")
        if self.engine_kwargs["prefill_metrics"]:
            cmd.append("--prefill-metrics")
        if not self.with_router:
            cmd.append("--no-router")
        if not self.workers_endpoint:
            cmd.append("--no-workers-endpoint")
        if self.health_check_interval_s is None:
            cmd += ["--health-check-interval", "0"]
        else:
            cmd += ["--health-check-interval", str(self.health_check_interval_s)]
        self.log_path = os.path.join(self._tmpdir, "sim.log")
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + self.start_timeout_s
        while not os.path.exists(ready):
            if self._proc.poll() is not None:
                with open(self.log_path, encoding="utf-8", errors="replace") as f:
                    err = f.read()
                raise RuntimeError(f"simulator process exited with {self._proc.returncode}: {err[-2000:]}")
            if time.monotonic() > deadline:
                self._stop_process()
                raise TimeoutError("simulator process did not become ready in time")
            time.sleep(0.05)
        with open(ready, encoding="utf-8") as f:
            info = json.load(f)
        self.engine_urls = info["engines"]
        self.router_url = info.get("router")

    def _stop_process(self) -> None:
        p = self._proc
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGINT)
            try:
                p.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        self._proc = None
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None
