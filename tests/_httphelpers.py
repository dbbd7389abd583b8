"""Loopback HTTP servers and helpers for the poller, discovery, lifecycle and scrape tests.

`FakeHTTP` is a real `ThreadingHTTPServer` bound to 127.0.0.1:0 (the kernel's free port,
held from the start) whose routes are plain callables, switchable while it runs: a route can
answer text, JSON, hang, or stream a huge body. `RefusedPort` holds a loopback port that
refuses connections, for a dead engine or router URL.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable

DATA = Path(__file__).parent / "data"


def read_data(name: str) -> str:
    return (DATA / name).read_text()


class RefusedPort:
    """A loopback port bound but never listening, held until ``close()`` (or the ``with``
    block ends): a connection to it is refused at once, and no other process can start
    listening on it meanwhile (a free port merely probed could be taken and answer)."""

    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> "RefusedPort":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Reply:
    def __init__(self, status=200, body: bytes | str = b"", ctype="text/plain; version=0.0.4",
                 hang_s: float = 0.0, stream_bytes: int = 0):
        self.status = status
        self.body = body.encode() if isinstance(body, str) else body
        self.ctype = ctype
        self.hang_s = hang_s
        self.stream_bytes = stream_bytes


def text(body: str, status=200) -> Reply:
    return Reply(status, body)


def js(obj, status=200) -> Reply:
    return Reply(status, json.dumps(obj), "application/json")


def html(status=200) -> Reply:
    return Reply(status, "<html><head><title>502 Bad Gateway</title></head><body>nginx</body></html>",
                 "text/html")


def hang(seconds: float) -> Reply:
    return Reply(hang_s=seconds)


def huge(nbytes: int) -> Reply:
    return Reply(stream_bytes=nbytes)


class FakeHTTP:
    """routes: {(METHOD, path): callable(body_bytes) -> Reply}."""

    def __init__(self) -> None:
        self.routes: dict[tuple[str, str], Callable[[bytes], Reply]] = {}
        self.requests: list[tuple[str, str, bytes]] = []
        self._stop = threading.Event()
        outer = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # quiet
                pass

            def _serve(self, method: str) -> None:
                n = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(n) if n else b""
                outer.requests.append((method, self.path, body))
                fn = outer.routes.get((method, self.path))
                if fn is None:
                    r = Reply(404, b'{"detail":"Not Found"}', "application/json")
                else:
                    r = fn(body)
                if r.hang_s:
                    outer._stop.wait(r.hang_s)
                    try:
                        self.send_response(200)
                        self.send_header("content-length", "0")
                        self.end_headers()
                    except OSError:
                        pass
                    return
                try:
                    self.send_response(r.status)
                    self.send_header("content-type", r.ctype)
                    if r.stream_bytes:
                        # no content-length: the client must stop reading on its own
                        self.send_header("connection", "close")
                        self.end_headers()
                        chunk = b"x_metric 1\n" * 6000
                        sent = 0
                        while sent < r.stream_bytes and not outer._stop.is_set():
                            self.wfile.write(chunk)
                            sent += len(chunk)
                        self.close_connection = True
                        return
                    self.send_header("content-length", str(len(r.body)))
                    self.end_headers()
                    self.wfile.write(r.body)
                except OSError:
                    pass

            def do_GET(self):
                self._serve("GET")

            def do_POST(self):
                self._serve("POST")

        # bound here, to a port the kernel picks: nothing can take it between choosing and binding
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.port = self.server.server_address[1]
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def route(self, method: str, path: str, reply: Reply | Callable[[bytes], Reply]) -> None:
        self.routes[(method, path)] = reply if callable(reply) else (lambda _b, r=reply: r)

    def start(self) -> "FakeHTTP":
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def sglang_metrics(capacity: int, used: int, *, running: int = 1, queued: int = 0, hit: float = 0.5,
                   tp: int = 1, model: str = "m") -> str:
    """A small SGLang /metrics body in prometheus_client's format (one series per TP rank)."""
    lines = []
    for name, val in (("sglang:max_total_num_tokens", capacity), ("sglang:num_used_tokens", used),
                      ("sglang:token_usage", used / capacity), ("sglang:num_running_reqs", running),
                      ("sglang:num_queue_reqs", queued), ("sglang:cache_hit_rate", hit)):
        lines.append(f"# HELP {name} x")
        lines.append(f"# TYPE {name} gauge")
        for r in range(tp):
            lines.append(f'{name}{{engine_type="unified",model_name="{model}",moe_ep_rank="0",pp_rank="0",'
                         f'tp_rank="{r}"}} {float(val)}')
    return "\n".join(lines) + "\n"


def wait_until(pred: Callable[[], object], timeout: float = 10.0, interval: float = 0.05,
               what: str = "condition"):
    """Poll ``pred`` until it returns something truthy (returned), failing after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def env_without_proxies() -> dict:
    env = dict(os.environ)
    for k in list(env):
        if k.lower() in ("http_proxy", "https_proxy", "all_proxy"):
            env.pop(k)
    env["NO_PROXY"] = "127.0.0.1,localhost"
    return env
