"""A minimal asyncio HTTP/1.1 server for ``/metrics`` (Prometheus text) and ``/health`` (200 or 503).

Only GET and HEAD, one request per connection: enough for Prometheus scrapes and
probes without a web framework in the frontend.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

MAX_HEADER_BYTES = 16 * 1024
READ_TIMEOUT_S = 10.0
_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 400: "Bad Request", 503: "Service Unavailable"}


class HttpServer:
    def __init__(self, registry: CollectorRegistry, is_serving: Callable[[], bool]):
        self._registry = registry
        self._is_serving = is_serving
        self._server: asyncio.AbstractServer | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(self._handle, host, port, limit=MAX_HEADER_BYTES)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    def _route(self, method: str, path: str) -> tuple[int, str, bytes]:
        path = path.split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            return 405, "text/plain", b"only GET and HEAD\n"
        if path == "/metrics":
            return 200, CONTENT_TYPE_LATEST, generate_latest(self._registry)
        if path == "/health":
            if self._is_serving():
                return 200, "text/plain", b"SERVING\n"
            return 503, "text/plain", b"NOT_SERVING\n"
        return 404, "text/plain", b"not found: try /metrics or /health\n"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
            parts = head.split(b"\r\n", 1)[0].decode("latin-1").split()
            if len(parts) != 3:
                status, ctype, body = 400, "text/plain", b"bad request line\n"
            else:
                status, ctype, body = self._route(parts[0], parts[1])
            header = (
                f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            )
            writer.write(header.encode("latin-1") + (b"" if parts and parts[0] == "HEAD" else body))
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            pass
        except Exception:  # noqa: BLE001 - one bad connection must not take the server down
            log.exception("HTTP request failed")
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
