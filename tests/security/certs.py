"""Throwaway certificates for the security tests, made with trustme in a temporary directory (never committed).

``Pki`` holds a public CA and the frontend's certificate for its public ports, an internal CA and the one
certificate every service shows the others (trustme's leaf certificates serve as server and client
certificates), and a rogue CA with a certificate of its own that no kvgrid service trusts.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

import trustme

NAMES = ("localhost", "127.0.0.1")


@dataclass(frozen=True, slots=True)
class Pair:
    cert: str
    key: str

    def read(self) -> tuple[bytes, bytes]:
        return pathlib.Path(self.cert).read_bytes(), pathlib.Path(self.key).read_bytes()


@dataclass(frozen=True, slots=True)
class Pki:
    public_ca: str
    public: Pair
    internal_ca: str
    internal: Pair
    rogue_ca: str
    rogue: Pair

    def internal_flags(self) -> list[str]:
        ca, cert, key = self.internal_ca, self.internal.cert, self.internal.key
        return ["--internal-tls-ca", ca, "--internal-tls-cert", cert, "--internal-tls-key", key]

    def public_flags(self) -> list[str]:
        return ["--tls-cert-file", self.public.cert, "--tls-key-file", self.public.key]


def _issue(ca: trustme.CA, directory: pathlib.Path, name: str) -> Pair:
    leaf = ca.issue_cert(*NAMES)
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    cert.write_bytes(b"".join(blob.bytes() for blob in leaf.cert_chain_pems))
    leaf.private_key_pem.write_to_path(str(key))
    return Pair(str(cert), str(key))


def _ca(directory: pathlib.Path, name: str) -> tuple[trustme.CA, str]:
    ca = trustme.CA()
    path = directory / f"{name}-ca.crt"
    ca.cert_pem.write_to_path(str(path))
    return ca, str(path)


def make_pki(directory: pathlib.Path) -> Pki:
    public_ca, public_ca_path = _ca(directory, "public")
    internal_ca, internal_ca_path = _ca(directory, "internal")
    rogue_ca, rogue_ca_path = _ca(directory, "rogue")
    return Pki(
        public_ca_path,
        _issue(public_ca, directory, "frontend"),
        internal_ca_path,
        _issue(internal_ca, directory, "service"),
        rogue_ca_path,
        _issue(rogue_ca, directory, "rogue"),
    )
