"""Errors a user can cause, and the one place they become gRPC status codes.

Domain code raises a ``KvgridError`` subclass with a message that names the
problem (and the field, for bad input). Servicer methods are wrapped with
``grpc_errors``: a ``KvgridError`` becomes its status code and message; any
other exception is logged with its traceback and answered INTERNAL with one
line, so a client never sees UNKNOWN with a Python traceback.
"""

from __future__ import annotations

import functools
import inspect
import logging

import grpc

log = logging.getLogger(__name__)


class KvgridError(Exception):
    code = grpc.StatusCode.INTERNAL


class InvalidArgument(KvgridError):
    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field


class ResourceExhausted(KvgridError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(KvgridError):
    code = grpc.StatusCode.UNAVAILABLE


class NotFound(KvgridError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(KvgridError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(KvgridError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(KvgridError):
    code = grpc.StatusCode.ABORTED


def error_for_code(code: grpc.StatusCode, message: str) -> KvgridError:
    """The KvgridError for a status another service answered with, so it passes on with the same code."""
    for cls in (ResourceExhausted, Unavailable, NotFound, AlreadyExists, FailedPrecondition, Aborted):
        if cls.code == code:
            return cls(message)
    error = KvgridError(message)
    error.code = code
    return error


def _status_of(exc: BaseException, method: str) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, KvgridError):
        return exc.code, str(exc)
    if isinstance(exc, grpc.aio.AioRpcError):  # a downstream call failed: pass its status on
        return exc.code(), exc.details() or exc.code().name
    log.exception("internal error in %s", method)
    return grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(exc).__name__}: {exc}"


def grpc_errors(method):
    """Wrap an async servicer method (unary or server-streaming) with the status mapping."""
    name = method.__qualname__

    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream_wrapper(self, request, context):
            try:
                async for item in method(self, request, context):
                    yield item
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001 - mapped to a status, never a traceback
                await context.abort(*_status_of(exc, name))

        return stream_wrapper

    @functools.wraps(method)
    async def unary_wrapper(self, request, context):
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001
            await context.abort(*_status_of(exc, name))

    return unary_wrapper
