"""gRPC server plumbing every service shares: options, health service, reflection, binding and dialing
(plaintext, or TLS with the credentials of ``services.common.tls``)."""

from __future__ import annotations

import asyncio
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.tls import TlsFiles, peer_credentials
from services.common.unparsable import UnparsableRequests

# Handshakes carry tokenizer files (a few MB); allow far more than gRPC's 4 MB default. The public port takes
# --max-request-bytes instead (see ``new_server``).
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
SERVER_OPTIONS = CHANNEL_OPTIONS + [
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
]

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def new_server(
    interceptors=(), max_receive_bytes: int = MAX_MESSAGE_BYTES, reuse_port: bool = False
) -> grpc.aio.Server:
    """A server whose unparsable requests answer INVALID_ARGUMENT (see ``unparsable``); a request larger than
    ``max_receive_bytes`` is refused RESOURCE_EXHAUSTED before it is parsed. ``reuse_port``: the port is shared
    with other processes that bind it the same way (SO_REUSEPORT: the kernel spreads new connections over them);
    without it (gRPC's own default is on) a second server on a taken port fails to bind."""
    options = [o for o in SERVER_OPTIONS if o[0] != "grpc.max_receive_message_length"]
    options.append(("grpc.max_receive_message_length", max_receive_bytes))
    options.append(("grpc.so_reuseport", int(reuse_port)))
    return grpc.aio.server(options=options, interceptors=[UnparsableRequests(), *interceptors])


def insecure_channel(addr: str, interceptors=()) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(addr, options=CHANNEL_OPTIONS, interceptors=list(interceptors))


def peer_channel(addr: str, tls: TlsFiles | None, options=(), server_name: str = "") -> grpc.aio.Channel:
    """A channel from one kvgrid service to another: mutual TLS with ``tls`` (plaintext without). ``server_name``:
    the name the peer's certificate must hold when ``addr`` is an IP address resolved from that name."""
    options = [*CHANNEL_OPTIONS, *options]
    if tls is None:
        return grpc.aio.insecure_channel(addr, options=options)
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    return grpc.aio.secure_channel(addr, peer_credentials(tls), options=options)


class Health:
    """The standard health service; status applies to "" and to each named service."""

    def __init__(self, server: grpc.aio.Server, service_names: list[str]):
        self._servicer = health.aio.HealthServicer()
        self._names = ["", *service_names]
        self._pending: set[asyncio.Task] = set()  # the loop keeps only weak references to tasks
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)
        self.set(False)

    def set(self, serving: bool) -> None:
        """Call from the server's event loop; the change lands once the loop next runs (in call order)."""
        status = SERVING if serving else NOT_SERVING
        for name in self._names:
            # grpc's aio HealthServicer.set is a coroutine (it also wakes Watch streams).
            task = asyncio.get_running_loop().create_task(self._servicer.set(name, status))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)


def shutdown_requested() -> asyncio.Event:
    """An event set on the first SIGTERM or SIGINT: every service's process waits on it, then drains."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


def add_reflection(server: grpc.aio.Server, service_names: list[str]) -> None:
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)


def bind(server: grpc.aio.Server, host: str, port: int, credentials: grpc.ServerCredentials | None = None) -> int:
    """Bind host:port (TLS with ``credentials``) and return the bound port (useful with port 0 in tests)."""
    addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    bound = server.add_insecure_port(addr) if credentials is None else server.add_secure_port(addr, credentials)
    if bound == 0:
        raise OSError(f"cannot bind {addr}: address in use or not available")
    return bound
