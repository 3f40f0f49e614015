"""Errors as OpenAI's error object (``{"error": {"message", "type", "param", "code"}}``) with the HTTP status
of the gRPC code the same failure has on the gRPC API."""

from __future__ import annotations

import json
import logging

import grpc
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.common.errors import InvalidArgument, KvgridError, NotFound
from services.tokenizer.openai.protocol import UNSUPPORTED_TYPE
from services.tokenizer.openai.responses import ErrorInfo, ErrorResponse

log = logging.getLogger(__name__)

# gRPC code -> (HTTP status, OpenAI error type)
STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.ABORTED: (500, "server_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
}


class ModelNotFound(NotFound):
    def __init__(self, model: str, served: str):
        super().__init__(f"the model `{model}` does not exist; this server serves `{served}`")


def error_body(exc: KvgridError, param: str | None = None) -> tuple[int, ErrorResponse]:
    status, kind = STATUS.get(exc.code, (500, "server_error"))
    code = "model_not_found" if isinstance(exc, ModelNotFound) else exc.code.name.lower()
    message = str(exc)
    if isinstance(exc, InvalidArgument) and param is not None and param != exc.field:
        message = param + message[len(exc.field) :]  # "<field>: problem", in the client's own names
    return status, ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=code))


def error_response(exc: KvgridError, param: str | None = None) -> JSONResponse:
    status, body = error_body(exc, param)
    return JSONResponse(body.model_dump(), status_code=status)


def sse_error(exc: KvgridError, param: str | None = None) -> str:
    """An error after the stream began: one event carrying the error object."""
    return f"data: {json.dumps(error_body(exc, param)[1].model_dump())}\n\n"


async def kvgrid_error_handler(request: Request, exc: KvgridError) -> JSONResponse:
    param = getattr(exc, "public_field", None) or getattr(exc, "field", None)
    return error_response(exc, param)


async def validation_error_handler(request: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(*invalid_body(exc.errors()))


def invalid_body(errors) -> tuple[InvalidArgument, str | None]:
    """A body that does not parse, has a field of the wrong type or one kvgrid does not support (pydantic's
    errors, from the HTTP route or a batch line): 400 naming the first bad field."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request body"}
    if first.get("type") == UNSUPPORTED_TYPE:
        field = first["ctx"]["field"]
        return InvalidArgument(field, f"not supported by kvgrid ({first['ctx']['why']})"), field
    loc = [part for part in first.get("loc", ()) if part != "body"]
    param = _dotted(loc)
    return InvalidArgument(param or "body", first.get("msg", "invalid value")), param or None


async def http_error_handler(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's own refusals (a body that is not JSON, an unknown path, a wrong method) as OpenAI's error object."""
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
    body = ErrorResponse(error=ErrorInfo(message=str(exc.detail), type=kind, param=None, code=code))
    return JSONResponse(body.model_dump(), status_code=exc.status_code, headers=getattr(exc, "headers", None))


async def internal_error_handler(request: Request, exc: Exception) -> JSONResponse:
    log.exception("internal error in %s %s", request.method, request.url.path)
    error = KvgridError(f"internal error: {type(exc).__name__}: {exc}")
    return error_response(error)


def _dotted(loc: list) -> str:
    """("messages", 1, "role") -> "messages[1].role"; pydantic's union member names are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _is_type_name(part):
            out += f".{part}" if out else str(part)
    return out


def _is_type_name(part: str) -> bool:
    return "[" in part or part in ("str", "int", "float", "bool", "list", "dict", "function-after", "TextPart")
