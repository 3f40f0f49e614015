"""What an HTTP request must pass before the app reads it: an accepted API key (``--api-key``) and a body no
larger than ``--max-request-bytes``. Refusals carry OpenAI's error object: 401 and 413.

Both are plain ASGI middleware around the FastAPI app, outside its routing: an unauthenticated request is
answered before its body is read, and a body is never held whole past the limit (a declared Content-Length over
it is refused before any of the body is read; a chunked body is counted as it arrives). Before a 413 the rest of
the body is read and dropped, up to ``DRAIN_BYTES`` and ``DRAIN_SECONDS``: a client still sending when the server
closes would otherwise see the connection reset instead of the answer.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from services.common.auth import ApiKeys
from services.tokenizer.openai.responses import ErrorInfo, ErrorResponse

# What a refused body may still send, read and dropped so that its client reads the 413 (then the connection closes).
DRAIN_BYTES = 8 * 2**20
DRAIN_SECONDS = 2.0

# Reachable without a key: load balancers and probes have none. /metrics too unless --metrics-require-key.
OPEN_PATHS = ("/health",)
METRICS_PATH = "/metrics"


@dataclass(frozen=True, slots=True)
class HttpGuards:
    api_keys: ApiKeys | None = None  # None: the API is open
    metrics_require_key: bool = False
    max_body_bytes: int = 16 * 2**20


def _header(scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("utf-8", "replace")
    return None


async def send_error(send, status: int, message: str, code: str, headers: tuple = ()) -> None:
    error = ErrorResponse(error=ErrorInfo(message=message, type="invalid_request_error", param=None, code=code))
    body = json.dumps(error.model_dump()).encode()
    start = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]
    await send({"type": "http.response.start", "status": status, "headers": start})
    await send({"type": "http.response.body", "body": body})


class RequireApiKey:
    """Every path but /health (and /metrics, unless ``metrics_require_key``) needs ``Authorization: Bearer <key>``
    with an accepted key; else 401."""

    def __init__(self, app, keys: ApiKeys, metrics_require_key: bool = False):
        self.app = app
        self._keys = keys
        self._open = OPEN_PATHS if metrics_require_key else (*OPEN_PATHS, METRICS_PATH)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in self._open:
            return await self.app(scope, receive, send)
        refusal = self._keys.refusal(_header(scope, b"authorization"))
        if refusal is None:
            return await self.app(scope, receive, send)
        await send_error(send, 401, refusal, "invalid_api_key", ((b"www-authenticate", b"Bearer"),))


class LimitBody:
    """Bodies over ``max_bytes`` get 413 and the connection is closed (the rest of the body is not read)."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def _refuse(self, receive, send, drain: bool) -> None:
        if drain:
            await _drain(receive)
        message = f"the request body is larger than {self.max_bytes} bytes (--max-request-bytes)"
        await send_error(send, 413, message, "request_too_large", ((b"connection", b"close"),))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = _header(scope, b"content-length")
        if length is not None:  # the server reads no more than this (HTTP/1.1 framing)
            if length.strip().isdigit() and int(length) > self.max_bytes:
                return await self._refuse(receive, send, drain=int(length) <= DRAIN_BYTES)
            return await self.app(scope, receive, send)
        # No Content-Length: a chunked body, or none. Read it up to the limit before the app sees any of it.
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return await self._refuse(receive, send, drain=message.get("more_body", False))
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        pending = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay():
            return pending.pop() if pending else await receive()  # then disconnects, as they come

        await self.app(scope, replay, send)


async def _drain(receive) -> None:
    """Read and drop the request's remaining body, at most DRAIN_BYTES of it for at most DRAIN_SECONDS."""
    dropped = 0
    try:
        async with asyncio.timeout(DRAIN_SECONDS):
            while dropped < DRAIN_BYTES:
                message = await receive()
                if message["type"] != "http.request":
                    return
                dropped += len(message.get("body", b""))
                if not message.get("more_body", False):
                    return
    except TimeoutError:
        return
