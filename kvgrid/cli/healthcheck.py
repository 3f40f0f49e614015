"""``python -m kvgrid.cli.healthcheck HOST:PORT [SERVICE]``: exit 0 iff the gRPC health check says SERVING.

Container health checks (docker compose) call this; it imports grpc only, never torch, so it
runs in every image and answers within the timeout even when the server hangs.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(addr: str, service: str = "", timeout: float = 3.0) -> str:
    """The health status name reported by the server at ``addr`` (raises grpc.RpcError when unreachable)."""
    with grpc.insecure_channel(addr) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvgrid.cli.healthcheck", description=__doc__.splitlines()[0])
    parser.add_argument("addr", help="HOST:PORT of a kvgrid gRPC server")
    parser.add_argument("service", nargs="?", default="", help="service name to check ('' : the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    args = parser.parse_args(argv)
    try:
        status = check(args.addr, args.service, args.timeout)
    except grpc.RpcError as e:
        print(f"{args.addr}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    print(f"{args.addr}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
