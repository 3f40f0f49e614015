"""The public HTTP server's connections (services/tokenizer/openai/http_server.py), below the OpenAI routes."""

from __future__ import annotations

import asyncio
import socket

from fastapi import FastAPI

from services.tokenizer.openai.http_server import HttpServer


def test_accepted_connections_send_small_writes_at_once():
    """Nagle off on every accepted connection: uvicorn writes a response's head and body separately, and with
    Nagle on the body waits for the client's delayed ACK of the head (~40 ms a response on a kept-alive
    connection, a tenth of a short completion's time)."""
    app = FastAPI()

    @app.get("/ping")
    async def ping() -> dict:
        return {"ok": True}

    async def go() -> list[int]:
        server = HttpServer(app)
        port = await server.start("127.0.0.1", 0)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for _ in range(2):  # the second response is the one Nagle would hold
                writer.write(b"GET /ping HTTP/1.1\r\nHost: t\r\n\r\n")
                head = await reader.readuntil(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
                assert await reader.readexactly(length) == b'{"ok":true}'
            connections = server._server.server_state.connections
            return [
                c.transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
                for c in connections
            ]
        finally:
            writer.close()
            await server.close(grace=0)

    flags = asyncio.run(go())
    assert len(flags) == 1 and flags[0] != 0
