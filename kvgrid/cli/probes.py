"""How `kvgrid serve` asks a child whether it serves: the gRPC health check, over mutual TLS for the scheduler and
the worker when --internal-tls-* is set, or the frontend's HTTP /health when its ports take TLS."""

from __future__ import annotations

import functools
import http.client
import os
import socket
import ssl
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import config as cfg
from services.common.tls import internal_tls, peer_credentials

INTERNAL_SERVICES = ("worker", "scheduler")
PUBLIC_SERVICE = "tokenizer"


def is_serving(addr: str, credentials: grpc.ChannelCredentials | None = None) -> bool:
    """The gRPC health check of ``addr`` says SERVING (over TLS with ``credentials``)."""
    channel = grpc.insecure_channel(addr) if credentials is None else grpc.secure_channel(addr, credentials)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def https_health(host: str, port: int) -> bool:
    """GET /health over TLS answers 200; the certificate is not verified (serve asks its own child)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    connection = http.client.HTTPSConnection(host, port, timeout=2, context=context)
    try:
        connection.request("GET", "/health")
        return connection.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        connection.close()


def port_open(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
    except OSError:
        return False
    return True


def readiness_probe(
    name: str, security: cfg.SecurityConfig | None, addr: str, http_addr: tuple[str, int]
) -> Callable[[], bool] | None:
    """How serve asks child ``name`` at ``addr`` whether it serves, when plaintext gRPC health cannot (None: it
    can). The scheduler and the worker under mutual TLS are asked with serve's own internal certificate; the
    frontend under TLS on its HTTP /health at ``http_addr``, its certificate unverified (serve asks its own
    child); with client certificates required serve has none to present, and waits for the port to open."""
    if security is None:
        return None
    if name in INTERNAL_SERVICES and security.internal_tls_ca:
        return functools.partial(is_serving, addr, peer_credentials(internal_tls(security)))
    if name == PUBLIC_SERVICE and security.tls_cert_file:
        return functools.partial(port_open if security.tls_ca_file else https_health, *http_addr)
    return None


TCP_LISTEN = "0A"  # the st column of /proc/net/tcp for a listening socket


def listens(pid: int, ports: tuple[int, ...]) -> bool:
    """Process ``pid`` holds a listening TCP socket on each of ``ports`` (Linux /proc). The way to ask one of
    several processes sharing a port (SO_REUSEPORT): a connection to the port reaches any of them."""
    try:
        owned = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:  # closed meanwhile
                continue
            if target.startswith("socket:["):
                owned.add(target[len("socket:[") : -1])
        found = set()
        for table in ("tcp", "tcp6"):
            with open(f"/proc/{pid}/net/{table}") as f:
                next(f)  # the header
                for line in f:
                    cols = line.split()
                    port = int(cols[1].rsplit(":", 1)[1], 16)
                    if cols[3] == TCP_LISTEN and cols[9] in owned and port in ports:
                        found.add(port)
    except OSError:  # gone, or no /proc
        return False
    return found == set(ports)
