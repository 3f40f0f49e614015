"""API keys on the public API: ``authorization: Bearer <key>`` (gRPC metadata or HTTP header).

Keys come from ``--api-key`` (comma-separated; also ``KVGRID_API_KEY``) and ``--api-key-file`` (one per line).
A presented key is compared with every configured key, each through ``hmac.compare_digest`` of SHA-256
digests: the time taken depends neither on how much of a key matches nor on its length, nor on which key
matched. Keys are never logged; a refusal says only that the key was missing or wrong.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

import grpc

from services.common.config_sections import SecurityConfig

API_KEY_ENV = "KVGRID_API_KEY"
AUTHORIZATION = "authorization"
MISSING = "missing API key: send the header `Authorization: Bearer <key>`"
WRONG = "invalid API key"
# Servers answer their health checks without a key (load balancers and probes have none).
OPEN_SERVICES = ("grpc.health.v1.Health",)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def key_matches(presented: str, digests: Iterable[bytes]) -> bool:
    """Whether ``presented`` is one of the keys whose SHA-256 ``digests`` are given; constant time: every digest
    is compared, in full, whatever matched before."""
    given = _digest(presented)
    found = False
    for digest in digests:
        found |= hmac.compare_digest(given, digest)
    return found


def bearer_token(value: str | None) -> str | None:
    """``"Bearer <token>"`` -> the token (the scheme's case does not matter); None when absent or another scheme."""
    if not value:
        return None
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def parse_keys(text: str, separator: str, comments: bool = False) -> list[str]:
    """The non-empty keys in ``text``; with ``comments`` (a file), lines starting with ``#`` are skipped."""
    keys = (key.strip() for key in text.split(separator))
    return [key for key in keys if key and not (comments and key.startswith("#"))]


class ApiKeys:
    """The accepted keys, held as digests only."""

    def __init__(self, keys: Iterable[str]):
        self._digests = tuple(_digest(key) for key in dict.fromkeys(keys))
        if not self._digests:
            raise ValueError("no API key given")

    @classmethod
    def from_config(cls, security: SecurityConfig | None) -> ApiKeys | None:
        """The keys of ``--api-key`` and ``--api-key-file`` (read now), or None when none is set: the API is open."""
        if security is None:
            return None
        keys = parse_keys(security.api_key, ",")
        if security.api_key_file:
            try:
                with open(security.api_key_file, encoding="utf-8") as f:
                    keys += parse_keys(f.read(), "\n", comments=True)
            except OSError as e:
                raise ValueError(f"--api-key-file {security.api_key_file}: {e.strerror or e}") from None
            if not keys:
                raise ValueError(f"--api-key-file {security.api_key_file}: holds no key")
        return cls(keys) if keys else None

    def __len__(self) -> int:
        return len(self._digests)

    def __repr__(self) -> str:
        return f"ApiKeys({len(self)} keys)"

    def refusal(self, authorization: str | None) -> str | None:
        """Why a request with this ``Authorization`` value is refused, or None when its key is accepted."""
        token = bearer_token(authorization)
        if token is None:
            return MISSING
        return None if key_matches(token, self._digests) else WRONG


async def _unauthenticated(message: str, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)


def _refusing(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """``handler`` answering UNAUTHENTICATED, whatever its kind, without parsing the request."""

    async def refuse(request_or_iterator, context):
        await _unauthenticated(message, context)

    kinds = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
    replaced = {kind: refuse for kind in kinds if getattr(handler, kind) is not None}
    return handler._replace(request_deserializer=lambda data: None, **replaced)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Every method but the health service's needs ``authorization: Bearer <key>`` metadata with an accepted key;
    other calls end UNAUTHENTICATED before their request is read."""

    def __init__(self, keys: ApiKeys, open_services: tuple[str, ...] = OPEN_SERVICES):
        self._keys = keys
        self._open = tuple(f"/{name}/" for name in open_services)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(self._open):
            return handler
        authorization = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key == AUTHORIZATION:
                authorization = value if isinstance(value, str) else None
                break
        refusal = self._keys.refusal(authorization)
        return handler if refusal is None else _refusing(handler, refusal)


def call_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """gRPC call metadata carrying ``api_key`` (none without one)."""
    return ((AUTHORIZATION, f"Bearer {api_key}"),) if api_key else ()
