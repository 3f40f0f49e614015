"""uvicorn serving the HTTP app inside the frontend's event loop, beside the gRPC server."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import uvicorn
from fastapi import FastAPI

log = logging.getLogger(__name__)


class _EmbeddedServer(uvicorn.Server):
    """The frontend owns SIGTERM/SIGINT (it drains in order); uvicorn must not take them over."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class HttpServer:
    def __init__(self, app: FastAPI):
        self._app = app
        self._server: _EmbeddedServer | None = None
        self._task: asyncio.Task | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> int:
        """Bind (port 0 picks a free one) and serve; returns the bound port. Raises OSError when taken."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
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
