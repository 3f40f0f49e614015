"""Which schedulers a frontend routes to: ``--scheduler-addrs`` as a list of addresses, each a literal address or
a DNS name that may resolve to many (a Kubernetes headless Service gives one A record per scheduler pod)."""

from __future__ import annotations

import ipaddress
import socket


def _host_port(addr: str) -> tuple[str, str]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), port


def is_literal(addr: str) -> bool:
    try:
        ipaddress.ip_address(_host_port(addr)[0])
    except ValueError:
        return False
    return True


def resolve(addr: str) -> list[str]:
    """``addr`` itself when it is a literal address, a name with one address (gRPC re-resolves it on reconnect)
    or cannot be resolved now; else one ``ip:port`` per address (IPv4 preferred, as ``localhost`` has both)."""
    if is_literal(addr):
        return [addr]
    host, port = _host_port(addr)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return [addr]
    v4 = sorted({info[4][0] for info in infos if info[0] == socket.AF_INET})
    v6 = sorted({info[4][0] for info in infos if info[0] == socket.AF_INET6})
    ips = v4 or v6
    if len(ips) <= 1:
        return [addr]
    return [f"{ip}:{port}" if ":" not in ip else f"[{ip}]:{port}" for ip in ips]


def resolve_named(addrs: list[str]) -> dict[str, str]:
    """Every address of ``resolve`` for each of ``addrs``, with the DNS name it was resolved from ("" for an
    address given as is): under mutual TLS a scheduler's certificate is checked against that name, not its IP."""
    named: dict[str, str] = {}
    for addr in addrs:
        for out in resolve(addr):
            named.setdefault(out, "" if out == addr else _host_port(addr)[0])
    return named


def resolve_all(addrs: list[str]) -> list[str]:
    return list(resolve_named(addrs))
