"""TLS for every port, built in one place: the public ports (``--tls-*``) and mutual TLS between the services
(``--internal-tls-*``).

Public ports present ``--tls-cert-file``; with ``--tls-ca-file`` they also ask every client for a certificate
chaining to that CA. Internal ports (scheduler, worker) present ``--internal-tls-cert`` and refuse, during the TLS
handshake, any peer without a certificate chaining to ``--internal-tls-ca``; the frontend and the scheduler dial
with the same certificate, so each side verifies the other. A client verifies the server's name against the
address it dials (``ssl_target_name_override`` when that address is an IP resolved from a name).

The files are read when a server starts or a channel is made, not watched: certificates rotate by replacing the
files and restarting each service through its drain (SIGTERM: in-flight requests finish, then it exits).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass

import grpc

from services.common.config_sections import SecurityConfig


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM bytes: this side's certificate chain and key, and the CA the other side must chain to (None: any
    client, for a public port without client certificates)."""

    cert: bytes
    key: bytes
    ca: bytes | None = None

    def __repr__(self) -> str:  # never print a private key
        return f"TlsFiles(cert={len(self.cert)} bytes, key=<hidden>, ca={'set' if self.ca else 'none'})"


def read_pem(path: str, flag: str) -> bytes:
    """The file's bytes; a ValueError naming the flag when it cannot be read or holds no PEM block."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"{flag} {path}: {e.strerror or e}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{flag} {path}: not a PEM file")
    return data


def public_tls(security: SecurityConfig | None) -> TlsFiles | None:
    """The public ports' certificate (and client CA), or None for plaintext."""
    if security is None or not security.tls_cert_file:
        return None
    return TlsFiles(
        read_pem(security.tls_cert_file, "--tls-cert-file"),
        read_pem(security.tls_key_file, "--tls-key-file"),
        read_pem(security.tls_ca_file, "--tls-ca-file") if security.tls_ca_file else None,
    )


def internal_tls(security: SecurityConfig | None) -> TlsFiles | None:
    """This service's certificate toward the other services and their CA, or None for plaintext."""
    if security is None or not security.internal_tls_ca:
        return None
    return TlsFiles(
        read_pem(security.internal_tls_cert, "--internal-tls-cert"),
        read_pem(security.internal_tls_key, "--internal-tls-key"),
        read_pem(security.internal_tls_ca, "--internal-tls-ca"),
    )


def server_credentials(tls: TlsFiles | None) -> grpc.ServerCredentials | None:
    """A server presenting ``tls.cert`` (None: plaintext); with ``tls.ca`` a client without a certificate chaining
    to it is refused during the TLS handshake, before any RPC."""
    if tls is None:
        return None
    return grpc.ssl_server_credentials(
        [(tls.key, tls.cert)], root_certificates=tls.ca, require_client_auth=tls.ca is not None
    )


def channel_credentials(
    ca: bytes | None, cert: bytes | None = None, key: bytes | None = None
) -> grpc.ChannelCredentials:
    """A TLS client trusting ``ca`` (None: the system's roots), presenting ``cert`` when given."""
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def peer_credentials(tls: TlsFiles) -> grpc.ChannelCredentials:
    """A service dialing another: verifies it against the internal CA and presents its own certificate."""
    return channel_credentials(tls.ca, tls.cert, tls.key)


def uvicorn_ssl_options(security: SecurityConfig | None) -> dict:
    """uvicorn.Config's TLS settings for the public HTTP port (empty: plaintext)."""
    if security is None or not security.tls_cert_file:
        return {}
    options = {"ssl_certfile": security.tls_cert_file, "ssl_keyfile": security.tls_key_file}
    if security.tls_ca_file:
        options.update(ssl_ca_certs=security.tls_ca_file, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return options


def describe_public(security: SecurityConfig | None) -> str:
    if security is None or not security.tls_cert_file:
        return "plaintext"
    return "TLS, client certificates required" if security.tls_ca_file else "TLS"


def describe_internal(security: SecurityConfig | None) -> str:
    return "mutual TLS" if security is not None and security.internal_tls_ca else "plaintext, unauthenticated"
