"""``python -m kvgrid.cli.healthcheck HOST:PORT [SERVICE]``: exit 0 iff the gRPC health check says SERVING.

Container health checks (docker compose, Helm exec probes) call this; it imports grpc only, never torch, so it
runs in every image and answers within the timeout even when the server hangs.

TLS: ``--ca-file`` (with ``--cert-file``/``--key-file`` for a port that asks for a client certificate). Without
them, in a container whose service runs with mutual TLS (``KVGRID_INTERNAL_TLS_CA``, ``_CERT`` and ``_KEY`` set), it
dials with the service's own internal certificate, as its peers do; ``--plaintext`` dials in the clear regardless
(e.g. the frontend's public port when only its internal link takes TLS).
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.config import env_name
from services.common.tls import channel_credentials, read_pem

INTERNAL_TLS = ("internal_tls_ca", "internal_tls_cert", "internal_tls_key")


def check(
    addr: str, service: str = "", timeout: float = 3.0, credentials: grpc.ChannelCredentials | None = None
) -> str:
    """The health status name reported by the server at ``addr`` (raises grpc.RpcError when unreachable)."""
    channel = grpc.insecure_channel(addr) if credentials is None else grpc.secure_channel(addr, credentials)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def credentials(args: argparse.Namespace, environ=os.environ) -> grpc.ChannelCredentials | None:
    """TLS from the flags, else from the service's --internal-tls-* variables, else None (plaintext)."""
    if args.plaintext:
        return None
    ca, cert, key = args.ca_file, args.cert_file, args.key_file
    if not ca and all(environ.get(env_name(name)) for name in INTERNAL_TLS):
        ca, cert, key = (environ[env_name(name)] for name in INTERNAL_TLS)
    if not ca:
        return None
    return channel_credentials(
        read_pem(ca, "--ca-file"),
        read_pem(cert, "--cert-file") if cert else None,
        read_pem(key, "--key-file") if key else None,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvgrid.cli.healthcheck", description=__doc__.splitlines()[0])
    parser.add_argument("addr", help="HOST:PORT of a kvgrid gRPC server")
    parser.add_argument("service", nargs="?", default="", help="service name to check ('' : the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    parser.add_argument("--ca-file", default="", help="dial with TLS, trusting this CA (PEM)")
    parser.add_argument("--cert-file", default="", help="client certificate (PEM) for a port that asks for one")
    parser.add_argument("--key-file", default="", help="private key (PEM) of --cert-file")
    parser.add_argument("--plaintext", action="store_true", help="no TLS, whatever the environment says")
    args = parser.parse_args(argv)
    try:
        status = check(args.addr, args.service, args.timeout, credentials(args))
    except ValueError as e:
        print(f"{args.addr}: {e}", file=sys.stderr)
        return 1
    except grpc.RpcError as e:
        print(f"{args.addr}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    print(f"{args.addr}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
