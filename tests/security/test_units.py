"""The security pieces alone: constant-time key comparison, key sources, the flags' checks, TLS file reading, and
what `kvgrid serve` hands its children (no secret on a command line, internal services on loopback)."""

from __future__ import annotations

import argparse
import hmac

import grpc
import pytest

from kvgrid.cli import connect, serve
from services.common import auth
from services.common import config as cfg
from services.common.auth import ApiKeys, bearer_token, key_matches
from services.common.config import HttpConfig, SecurityConfig
from services.common.tls import TlsFiles, internal_tls, public_tls, read_pem, server_credentials, uvicorn_ssl_options

KEYS = ["alpha-key-0001", "beta-key-0002", "gamma-key-0003"]


def test_every_key_is_compared_in_full_through_compare_digest_whatever_matches(monkeypatch):
    """Constant time: the presented key is hashed to 32 bytes and compared with hmac.compare_digest against
    every configured key's digest, so the time taken depends neither on a matching prefix nor on its length,
    nor on which key (if any) matched."""
    calls = []
    compare = hmac.compare_digest

    def counting(a, b):
        calls.append((len(a), len(b)))
        return compare(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    keys = ApiKeys(KEYS)
    for presented, accepted in (
        (KEYS[0], True),
        (KEYS[2], True),
        ("alpha-key-0002", False),  # all but the last character match
        ("a", False),
        ("x" * 10_000, False),
        ("", False),
    ):
        calls.clear()
        assert key_matches(presented, keys._digests) is accepted
        assert calls == [(32, 32)] * len(KEYS), presented


def test_bearer_tokens_and_refusals():
    assert bearer_token("Bearer abc") == "abc" and bearer_token("bearer  abc ") == "abc"
    assert bearer_token(None) is None and bearer_token("") is None
    assert bearer_token("Basic abc") is None and bearer_token("Bearer") is None and bearer_token("abc") is None
    keys = ApiKeys(KEYS)
    assert keys.refusal(None) == auth.MISSING and keys.refusal("Basic x") == auth.MISSING
    assert keys.refusal("Bearer nope") == auth.WRONG and keys.refusal(f"Bearer {KEYS[1]}") is None
    assert KEYS[0] not in repr(keys) and repr(keys) == "ApiKeys(3 keys)"


def test_keys_come_from_the_flag_and_the_file(tmp_path):
    assert ApiKeys.from_config(SecurityConfig()) is None and ApiKeys.from_config(None) is None
    key_file = tmp_path / "keys"
    key_file.write_text(f"# rotated 2024\n\n  {KEYS[1]}  \n{KEYS[2]}\n")
    keys = ApiKeys.from_config(SecurityConfig(api_key=f" {KEYS[0]} ,,", api_key_file=str(key_file)))
    assert len(keys) == 3 and all(keys.refusal(f"Bearer {k}") is None for k in KEYS)
    assert keys.refusal("Bearer # rotated 2024") == auth.WRONG
    assert len(ApiKeys.from_config(SecurityConfig(api_key="#not-a-comment"))) == 1  # only a file has comments
    with pytest.raises(ValueError, match="--api-key-file .*missing"):
        ApiKeys.from_config(SecurityConfig(api_key_file=str(tmp_path / "missing")))
    key_file.write_text("# nothing yet\n")
    with pytest.raises(ValueError, match="holds no key"):
        ApiKeys.from_config(SecurityConfig(api_key_file=str(key_file)))


def test_the_flags_are_checked_together():
    assert SecurityConfig(tls_cert_file="c").validate() == ["--tls-cert-file and --tls-key-file go together"]
    assert SecurityConfig(tls_ca_file="ca").validate() == ["--tls-ca-file needs --tls-cert-file and --tls-key-file"]
    assert SecurityConfig(internal_tls_ca="ca", internal_tls_cert="c").validate() == [
        "--internal-tls-ca, --internal-tls-cert and --internal-tls-key go together"
    ]
    assert HttpConfig().validate() == []
    assert HttpConfig(http_header_timeout=0, http_max_connections=-1).validate() == [
        "--http-header-timeout must be > 0, got 0",
        "--http-max-connections must be >= 0 (0: no limit), got -1",
    ]
    config = cfg.build_config((HttpConfig,), environ={"KVGRID_HTTP_MAX_HEADER_BYTES": "32KiB"})
    assert config.http.http_max_header_bytes == 32 * 1024


def test_tls_files_are_read_once_with_errors_naming_the_flag(tmp_path, pki):
    with pytest.raises(ValueError, match="--tls-cert-file .*: No such file"):
        read_pem(str(tmp_path / "none.pem"), "--tls-cert-file")
    (tmp_path / "plain.txt").write_text("not a certificate")
    with pytest.raises(ValueError, match="--internal-tls-ca .*: not a PEM file"):
        read_pem(str(tmp_path / "plain.txt"), "--internal-tls-ca")
    assert public_tls(SecurityConfig()) is None and internal_tls(SecurityConfig()) is None
    assert server_credentials(None) is None and uvicorn_ssl_options(SecurityConfig()) == {}
    public = SecurityConfig(tls_cert_file=pki.public.cert, tls_key_file=pki.public.key, tls_ca_file=pki.public_ca)
    files = public_tls(public)
    assert files.ca is not None and "key=<hidden>" in repr(files) and "PRIVATE" not in repr(files)
    assert isinstance(server_credentials(files), grpc.ServerCredentials)
    assert uvicorn_ssl_options(public)["ssl_ca_certs"] == pki.public_ca
    internal = SecurityConfig(
        internal_tls_ca=pki.internal_ca, internal_tls_cert=pki.internal.cert, internal_tls_key=pki.internal.key
    )
    assert isinstance(internal_tls(internal), TlsFiles) and internal_tls(internal).ca is not None


def parse(argv: list[str]) -> cfg.Config:
    parser = argparse.ArgumentParser()
    cfg.add_arguments(parser)
    return cfg.build_config(cfg.ALL_SECTIONS, parser.parse_args(argv), environ={})


def test_serve_keeps_secrets_off_command_lines_and_internal_services_on_loopback():
    config = serve.child_config(parse(["--host", "0.0.0.0", "--api-key", "s3cret", "--api-key-file", "/k"]))
    children = {c.name: c for c in serve.build_children(config)}
    for name, child in children.items():
        assert "s3cret" not in child.argv and "--api-key" not in child.argv, name
        assert child.argv[child.argv.index("--api-key-file") + 1] == "/k"  # a path is no secret
    assert children["tokenizer"].env == {"KVGRID_API_KEY": "s3cret"}
    assert children["worker"].env == {} and children["scheduler"].env == {}
    assert serve.service_env("worker", config, environ={"KVGRID_API_KEY": "inherited"}) == {"KVGRID_API_KEY": ""}
    host = {name: c.argv[c.argv.index("--host") + 1] for name, c in children.items()}
    assert host == {"worker": "127.0.0.1", "scheduler": "127.0.0.1", "tokenizer": "0.0.0.0"}
    tokenizer = children["tokenizer"].argv
    assert tokenizer[tokenizer.index("--scheduler-addr") + 1].startswith("127.0.0.1:")
    assert children["worker"].grpc_addr.startswith("127.0.0.1:")


def test_the_cli_clients_check_their_tls_flags_before_calling(capsys, pki):
    def args(**flags) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        connect.add_connection_arguments(parser)
        return parser.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in flags.items()])

    assert connect.credentials(args()) is None
    assert isinstance(connect.credentials(args(ca_file=pki.public_ca)), grpc.ChannelCredentials)
    assert connect.bad_connection_arguments("generate", args(cert_file=pki.internal.cert)) == 2
    assert connect.bad_connection_arguments("generate", args(ca_file="/no/such.pem")) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "kvgrid generate: --cert-file and --key-file need --ca-file (they are for TLS)",
        "kvgrid generate: --ca-file /no/such.pem: No such file or directory",
    ]
    assert connect.metadata(args(api_key="k")) == (("authorization", "Bearer k"),)
    assert connect.metadata(args(api_key="")) == ()
