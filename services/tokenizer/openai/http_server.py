"""uvicorn serving the HTTP app inside the frontend's event loop, beside the gRPC server.

Connections are bounded by uvicorn's own settings (--http-keep-alive-timeout, --http-max-connections,
--http-max-header-bytes) and by a header timeout uvicorn lacks: its keep-alive timer runs only between requests
and stops at a request's first byte, so a client sending nothing, or one header byte at a time, would hold its
connection forever. ``_HeaderTimeout`` closes a connection whose request line and headers are not all in within
--http-header-timeout of the connection opening or of the request's first byte.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from services.common.config_requests import HttpConfig

log = logging.getLogger(__name__)


class _HeaderTimeout(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's head; ``header_timeout`` is set per server."""

    header_timeout: float = HttpConfig().http_header_timeout

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = self.loop.call_later(self.header_timeout, self._head_overdue)

    def data_received(self, data: bytes) -> None:
        if self._head_timer is None and self.conn.their_state is h11.IDLE:  # a next request's first bytes
            self._head_timer = self.loop.call_later(self.header_timeout, self._head_overdue)
        super().data_received(data)
        if self._head_timer is not None and self.conn.their_state is not h11.IDLE:  # the head is in
            self._head_timer.cancel()
            self._head_timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)

    def _head_overdue(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def uvicorn_settings(http: HttpConfig) -> dict:
    """uvicorn.Config's connection settings for ``http``."""
    protocol = type("HeaderTimeoutH11Protocol", (_HeaderTimeout,), {"header_timeout": http.http_header_timeout})
    return {
        "http": protocol,
        "timeout_keep_alive": http.http_keep_alive_timeout,
        "limit_concurrency": http.http_max_connections or None,
        "h11_max_incomplete_event_size": http.http_max_header_bytes,
    }


class _EmbeddedServer(uvicorn.Server):
    """The frontend owns SIGTERM/SIGINT (it drains in order); uvicorn must not take them over."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class HttpServer:
    """``http``: connection limits (defaults without); ``ssl_options``: uvicorn's TLS settings (see
    ``services.common.tls.uvicorn_ssl_options``; empty: plaintext)."""

    def __init__(self, app: FastAPI, http: HttpConfig | None = None, ssl_options: dict | None = None):
        self._app = app
        self._settings = {**uvicorn_settings(http or HttpConfig()), **(ssl_options or {})}
        self._server: _EmbeddedServer | None = None
        self._task: asyncio.Task | None = None
        self.port = 0

    async def start(self, host: str, port: int, reuse_port: bool = False) -> int:
        """Bind (port 0 picks a free one) and serve; returns the bound port. Raises OSError when taken, unless
        ``reuse_port`` and every process on it binds with SO_REUSEPORT (then they share its connections)."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # IPPROTO_TCP named, not 0: asyncio turns Nagle off (TCP_NODELAY) only on sockets whose proto says TCP, and
        # accepted sockets inherit the listener's. With Nagle on, a response's body waits behind its unacknowledged
        # head for the client's delayed ACK: ~40 ms on every response after a connection's first.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((host, port))
        except OSError:
            sock.close()
            raise
        sock.setblocking(False)
        self.port = sock.getsockname()[1]
        # log_config=None: uvicorn's records go through kvgrid's handlers (text or JSON lines), not its own.
        config = uvicorn.Config(
            self._app,
            log_level="warning",
            log_config=None,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=5,
            **self._settings,
        )
        self._server = _EmbeddedServer(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises why it could not start
                raise OSError(f"the HTTP server on {host}:{self.port} stopped while starting")
            await asyncio.sleep(0.01)
        return self.port

    async def close(self, grace: float | None = None) -> None:
        """Stop accepting; running responses get up to ``grace`` seconds (default 5), then are cancelled."""
        if self._server is None or self._task is None:
            return
        if grace is not None:
            self._server.config.timeout_graceful_shutdown = max(grace, 0.0)
        self._server.should_exit = True
        with contextlib.suppress(Exception):
            await self._task
