"""How the command-line clients reach a frontend: address, API key, TLS.

``--api-key`` (or ``KVGRID_API_KEY``) travels as ``authorization: Bearer <key>`` metadata on every call;
``--ca-file`` switches to TLS and verifies the server against that CA (a plaintext client to a TLS port, or the
reverse, fails at the connection); ``--cert-file``/``--key-file`` present a client certificate, for a frontend
started with ``--tls-ca-file``.
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc

from services.common.auth import API_KEY_ENV, call_metadata
from services.common.server import CHANNEL_OPTIONS
from services.common.tls import channel_credentials, read_pem

DEFAULT_ADDR = "localhost:50051"
ADDR_ENV = "KVGRID_ADDR"


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--addr",
        default=os.environ.get(ADDR_ENV, DEFAULT_ADDR),
        help=f"HOST:PORT of the tokenizer frontend [env {ADDR_ENV}, default {DEFAULT_ADDR}]",
    )
    parser.add_argument("--timeout", type=float, default=None, help="seconds before the call is abandoned")
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV, ""),
        help=f"API key of a frontend started with --api-key [env {API_KEY_ENV}]",
    )
    parser.add_argument("--ca-file", default="", help="connect with TLS, trusting this CA (PEM); default: plaintext")
    parser.add_argument("--cert-file", default="", help="client certificate (PEM), with --ca-file and --key-file")
    parser.add_argument("--key-file", default="", help="private key (PEM) of --cert-file")


def credentials(args: argparse.Namespace) -> grpc.ChannelCredentials | None:
    """TLS credentials from --ca-file (None: plaintext); raises ValueError naming a bad file or flag."""
    if not args.ca_file:
        if args.cert_file or args.key_file:
            raise ValueError("--cert-file and --key-file need --ca-file (they are for TLS)")
        return None
    if bool(args.cert_file) != bool(args.key_file):
        raise ValueError("--cert-file and --key-file go together")
    cert = read_pem(args.cert_file, "--cert-file") if args.cert_file else None
    key = read_pem(args.key_file, "--key-file") if args.key_file else None
    return channel_credentials(read_pem(args.ca_file, "--ca-file"), cert, key)


def open_channel(args: argparse.Namespace) -> grpc.Channel:
    creds = credentials(args)
    if creds is None:
        return grpc.insecure_channel(args.addr)
    return grpc.secure_channel(args.addr, creds)


def open_aio_channel(args: argparse.Namespace) -> grpc.aio.Channel:
    creds = credentials(args)
    if creds is None:
        return grpc.aio.insecure_channel(args.addr, options=CHANNEL_OPTIONS)
    return grpc.aio.secure_channel(args.addr, creds, options=CHANNEL_OPTIONS)


def metadata(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """The metadata every call carries (the API key, when given)."""
    return call_metadata(args.api_key)


def bad_connection_arguments(command: str, args: argparse.Namespace) -> int | None:
    """Checks the TLS flags before any call: exit status 2 with one line on stderr, or None when usable."""
    try:
        credentials(args)
    except ValueError as e:
        print(f"kvgrid {command}: {e}", file=sys.stderr)
        return 2
    return None


def describe_error(err: grpc.RpcError, addr: str) -> str:
    """One line for a failed call; an unreachable server gets a hint instead of gRPC's details."""
    code = err.code()
    details = err.details() or ""
    if code == grpc.StatusCode.UNAVAILABLE and any(word in details.lower() for word in ("ssl", "tls", "handshake")):
        return f"no TLS connection to {addr} ({details}); check --ca-file, or drop it for a plaintext server"
    if code == grpc.StatusCode.UNAVAILABLE and "connect" in details.lower():
        return f"cannot reach a kvgrid server at {addr} (is `kvgrid serve` running? pass --addr HOST:PORT)"
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return f"UNAUTHENTICATED: {details} (pass --api-key or set {API_KEY_ENV})"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"no answer from {addr} in time"
    return f"{code.name}: {details}"
