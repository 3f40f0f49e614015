"""Requests that cannot be parsed answer INVALID_ARGUMENT, on every service.

grpc-python deserializes a request before any handler runs, and a message that
does not parse (a corrupt protobuf, invalid UTF-8 in a string field) would end
the call UNKNOWN or INTERNAL with the parser's exception. ``UnparsableRequests``,
installed on every server by ``services.common.server.new_server``, wraps each
method's deserializer so that a parse failure becomes a marker, and the method's
handler so that the marker is answered with INVALID_ARGUMENT and one line.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable

import grpc

MAX_REASON_CHARS = 200


class _Unparsable:
    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = reason


def _safe(deserializer: Callable[[bytes], object] | None) -> Callable[[bytes], object] | None:
    if deserializer is None:
        return None

    def parse(data: bytes) -> object:
        try:
            return deserializer(data)
        except Exception as exc:  # noqa: BLE001 - any parser failure is the caller's bad message
            lines = str(exc).strip().splitlines()
            return _Unparsable((lines[0] if lines else type(exc).__name__)[:MAX_REASON_CHARS])

    return parse


async def _refuse(context: grpc.aio.ServicerContext, method: str, bad: _Unparsable) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: the request cannot be parsed ({bad.reason})")


def _unary_request(behavior, method: str):
    if inspect.isasyncgenfunction(behavior):

        async def stream_out(request, context):
            if isinstance(request, _Unparsable):
                await _refuse(context, method, request)
            async for item in behavior(request, context):
                yield item

        return stream_out

    async def unary_out(request, context):
        if isinstance(request, _Unparsable):
            await _refuse(context, method, request)
        return await behavior(request, context)

    return unary_out


def _streamed_requests(behavior, method: str):
    def checked(requests: AsyncIterator, context) -> AsyncIterator:
        async def each():
            async for request in requests:
                if isinstance(request, _Unparsable):
                    await _refuse(context, method, request)
                yield request

        return each()

    if inspect.isasyncgenfunction(behavior):

        async def stream_out(requests, context):
            async for item in behavior(checked(requests, context), context):
                yield item

        return stream_out

    async def unary_out(requests, context):
        return await behavior(checked(requests, context), context)

    return unary_out


class UnparsableRequests(grpc.aio.ServerInterceptor):
    def __init__(self) -> None:
        # method -> (the handler as registered, its wrapped version): wrapped once, not per call.
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is None or cached[0] is not handler:
            cached = self._wrapped[method] = (handler, _wrap(handler, method))
        return cached[1]


def _wrap(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    wrapped = {}
    for kind in ("unary_unary", "unary_stream"):
        if getattr(handler, kind) is not None:
            wrapped[kind] = _unary_request(getattr(handler, kind), method)
    for kind in ("stream_unary", "stream_stream"):
        if getattr(handler, kind) is not None:
            wrapped[kind] = _streamed_requests(getattr(handler, kind), method)
    return handler._replace(request_deserializer=_safe(handler.request_deserializer), **wrapped)
