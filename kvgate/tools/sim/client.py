"""Lean asyncio HTTP/1.1 client (keep-alive pool, POST only) for the simulator."""
from __future__ import annotations

import asyncio
from typing import Any, List
from urllib.parse import urlsplit

from ..._json import dumps as _dumps, loads as _loads
from ..._aio import wait_for


class HttpPool:
    """Tiny asyncio HTTP/1.1 keep-alive client for ``POST`` to one base URL.

    The router uses it to proxy ``/generate``; benchmarks may use it as a lean
    client.  Measured on 2 cores: 50 concurrent sessions through httpx.AsyncClient
    took ~10x longer per request than through this pool (httpx's pool bookkeeping
    is O(connections) per request), while the simulator itself was idle.
    """

    def __init__(self, url: str, timeout_s: float) -> None:
        u = urlsplit(url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.hosthdr = f"{self.host}:{self.port}".encode()
        self.timeout_s = timeout_s
        self.idle: List[tuple] = []

    async def post(self, path: str, body: bytes) -> tuple:
        """(status, content_type, body).

        Raises ConnectionError when the worker is unreachable or drops the connection, and
        TimeoutError (not a ConnectionError) when it accepted the request but did not answer
        within ``timeout_s``: a slow worker is not a dead one.  On Python 3.11+
        ``asyncio.TimeoutError`` is the builtin ``TimeoutError``, an ``OSError``, so it is
        caught before the ``OSError`` clause."""
        for attempt in range(2):
            # the retry after a stale keep-alive connection opens a new one: the other idle
            # connections may have been closed by the server just as well
            reused = bool(self.idle) and attempt == 0
            if reused:
                reader, writer = self.idle.pop()
            else:
                try:
                    reader, writer = await wait_for(
                        asyncio.open_connection(self.host, self.port), 2.0)
                except (OSError, asyncio.TimeoutError) as e:
                    raise ConnectionError(f"connect to {self.host}:{self.port} failed: {e}") from None
            try:
                writer.write(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n" % (path.encode(), self.hosthdr, len(body)))
                writer.write(body)
                res = await wait_for(self._read(reader), self.timeout_s)
            except asyncio.TimeoutError:
                writer.close()
                raise TimeoutError(f"worker {self.host}:{self.port} did not answer within "
                                   f"{self.timeout_s} s") from None
            except (OSError, EOFError, asyncio.IncompleteReadError, ValueError) as e:
                writer.close()
                if reused and attempt == 0 and isinstance(e, (asyncio.IncompleteReadError, EOFError,
                                                              ConnectionResetError)):
                    continue  # stale keep-alive connection: the request never reached the worker
                raise ConnectionError(f"worker {self.host}:{self.port} dropped the request: {e}") from None
            except BaseException:
                writer.close()
                raise
            status, ctype, data, keep = res
            if keep:
                self.idle.append((reader, writer))
            else:
                writer.close()
            return status, ctype, data
        raise ConnectionError("unreachable")  # pragma: no cover

    @staticmethod
    async def _read(reader: asyncio.StreamReader) -> tuple:
        line = await reader.readline()
        if not line:
            raise EOFError("connection closed")
        parts = line.split(None, 2)
        status = int(parts[1])
        length, ctype, keep, chunked = None, "application/json", True, False
        while True:
            h = await reader.readline()
            if h in (b"\r\n", b"\n", b""):
                break
            k, _, v = h.partition(b":")
            k = k.strip().lower()
            v = v.strip()
            if k == b"content-length":
                length = int(v)
            elif k == b"content-type":
                ctype = v.decode("latin-1")
            elif k == b"connection" and v.lower() == b"close":
                keep = False
            elif k == b"transfer-encoding" and b"chunked" in v.lower():
                chunked = True
        if chunked:
            chunks = []
            while True:
                size = int((await reader.readline()).split(b";")[0], 16)
                if size == 0:
                    await reader.readline()
                    break
                chunks.append(await reader.readexactly(size))
                await reader.readexactly(2)
            data = b"".join(chunks)
        elif length is not None:
            data = await reader.readexactly(length)
        else:
            data = await reader.read()
            keep = False
        return status, ctype, data, keep

    def close(self) -> None:
        for _, w in self.idle:
            w.close()
        self.idle.clear()

    async def post_json(self, path: str, obj: Any) -> tuple:
        """POST a JSON body; returns (status, decoded JSON or None)."""
        status, _, data = await self.post(path, _dumps(obj))
        try:
            return status, _loads(data) if data else None
        except ValueError:
            return status, None
