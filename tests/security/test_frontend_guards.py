"""The frontend's guards in-process, in front of a fake scheduler: API keys on HTTP and gRPC, the body and message
size limit (--max-request-bytes), the HTTP header and keep-alive timeouts and connection limit, /openapi.json."""

from __future__ import annotations

import http.client
import json
import pathlib
import socket
import ssl
import time
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvgrid.v1 import generate_pb2, generate_pb2_grpc, worker_pb2
from services.common.config import (
    Config,
    HttpConfig,
    LimitsConfig,
    ModelConfig,
    NetworkConfig,
    ObservabilityConfig,
    SchedulerConfig,
    SecurityConfig,
)
from services.tokenizer.text_tokenizer import read_tokenizer_dir
from tests.tokenizer.conftest import LoopThread, wait_until
from tests.tokenizer.fake_scheduler import Script, start_fake_scheduler
from tests.worker.tiny import save_tiny_bytelevel_tokenizer

pytestmark = pytest.mark.timeout(120)

KEY = "guard-test-key"
MAX_BYTES = 64 * 1024
HEADER_TIMEOUT = 0.6
KEEP_ALIVE = 0.6
MAX_CONNECTIONS = 6


@dataclass
class Frontends:
    guarded: object  # TokenizerServer with a key, small limits and short timeouts
    open: object  # TokenizerServer with the defaults: no key
    client_certs: object  # TokenizerServer on TLS that asks clients for a certificate of the internal CA


def _config(scheduler_port: int, security: SecurityConfig, limits: LimitsConfig, http: HttpConfig) -> Config:
    network = NetworkConfig(host="127.0.0.1", scheduler_addr=f"127.0.0.1:{scheduler_port}")
    return Config(
        model=ModelConfig(),
        scheduler=SchedulerConfig(),
        observability=ObservabilityConfig(),
        network=network,
        security=security,
        limits=limits,
        http=http,
    )


@pytest.fixture(scope="module")
def frontends(tmp_path_factory, pki):
    from services.tokenizer.server import start_tokenizer

    files = read_tokenizer_dir(save_tiny_bytelevel_tokenizer(str(tmp_path_factory.mktemp("tok"))))
    info = worker_pb2.HandshakeResponse(
        model="tiny", block_size=16, num_blocks=64, max_model_len=256, vocab_size=300, eos_token_ids=[262]
    )
    info.tokenizer_files.update(files)
    loop = LoopThread()
    scheduler, fake, _, port = loop.run(start_fake_scheduler(info))
    fake.script = Script(deltas=[[70], [71], [72]])
    guarded = _config(
        port,
        SecurityConfig(api_key=f"other-key,{KEY}"),
        LimitsConfig(max_request_bytes=MAX_BYTES),
        HttpConfig(
            http_keep_alive_timeout=KEEP_ALIVE, http_header_timeout=HEADER_TIMEOUT, http_max_connections=MAX_CONNECTIONS
        ),
    )
    client_certs = SecurityConfig(
        tls_cert_file=pki.public.cert, tls_key_file=pki.public.key, tls_ca_file=pki.internal_ca
    )
    servers = Frontends(
        loop.run(start_tokenizer(guarded)),
        loop.run(start_tokenizer(_config(port, SecurityConfig(), LimitsConfig(), HttpConfig()))),
        loop.run(start_tokenizer(_config(port, client_certs, LimitsConfig(), HttpConfig()))),
    )
    every = (servers.guarded, servers.open, servers.client_certs)
    for server in every:
        wait_until(lambda s=server: s.state.serving, what="the frontend to serve")
    yield servers
    for server in every:
        loop.run(server.stop(0))
    loop.run(scheduler.stop(0))
    loop.close()


def request(server, method: str, path: str, body=None, headers=None, chunked: bool = False):
    """(status, headers, body) of one HTTP request on its own connection."""
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    try:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        headers = {"content-type": "application/json", **(headers or {})}
        if chunked:
            conn.request(
                method, path, body=iter([data[i : i + 4096] for i in range(0, len(data), 4096)]), headers=headers
            )
        else:
            conn.request(method, path, body=data, headers=headers)
        reply = conn.getresponse()
        return reply.status, dict(reply.getheaders()), reply.read()
    finally:
        conn.close()


KEYED = {"Authorization": f"Bearer {KEY}"}


def test_http_asks_for_a_key_but_not_on_health_or_metrics_by_default(frontends):
    server = frontends.guarded
    status, headers, body = request(server, "GET", "/v1/models")
    error = json.loads(body)["error"]
    assert status == 401 and headers["www-authenticate"] == "Bearer"
    assert error == {
        "message": error["message"],
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_api_key",
    }
    assert "missing API key" in error["message"]
    assert (
        "invalid API key"
        in json.loads(request(server, "GET", "/v1/models", headers={"Authorization": "Bearer x"})[2])["error"][
            "message"
        ]
    )
    assert request(server, "GET", "/v1/models", headers={"Authorization": f"bearer {KEY}"})[0] == 200
    assert request(server, "GET", "/v1/models", headers={"Authorization": "Bearer other-key"})[0] == 200
    assert request(server, "GET", "/no-such-route")[0] == 401  # nothing is answered unauthenticated but these:
    assert request(server, "GET", "/health")[0] == 200
    assert request(server, "GET", "/metrics")[0] == 200


def test_a_streamed_completion_with_the_key(frontends):
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 3, "stream": True}
    status, _, raw = request(frontends.guarded, "POST", "/v1/completions", body, KEYED)
    assert status == 200 and raw.decode().rstrip().endswith("data: [DONE]")


def test_openapi_json_is_served_behind_the_key_or_open_without_keys(frontends):
    assert request(frontends.guarded, "GET", "/openapi.json")[0] == 401
    for server, headers in ((frontends.guarded, KEYED), (frontends.open, {})):
        status, _, raw = request(server, "GET", "/openapi.json", headers=headers)
        paths = json.loads(raw)["paths"]
        assert status == 200 and {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"} <= set(paths)
        assert "/health" not in paths and "/metrics" not in paths
    assert request(frontends.open, "GET", "/v1/models")[0] == 200


def grpc_stub(server) -> tuple[grpc.Channel, generate_pb2_grpc.TextGenerationStub]:
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    return channel, generate_pb2_grpc.TextGenerationStub(channel)


def test_grpc_asks_for_the_key_on_every_method_but_health(frontends):
    channel, stub = grpc_stub(frontends.guarded)
    keyed = (("authorization", f"Bearer {KEY}"),)
    with channel:
        for metadata in ((), (("authorization", "Bearer nope"),), (("authorization", f"Basic {KEY}"),)):
            for call in (
                lambda m: stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), metadata=m, timeout=10),
                lambda m: list(stub.Generate(generate_pb2.GenerateRequest(prompt="hi"), metadata=m, timeout=10)),
                lambda m: stub.Tokenize(generate_pb2.TokenizeRequest(text="hi"), metadata=m, timeout=10),
                lambda m: list(
                    reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), metadata=m, timeout=10
                    )
                ),
            ):
                with pytest.raises(grpc.RpcError) as err:
                    call(metadata)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), metadata=keyed, timeout=10).vocab_size == 300
        responses = list(stub.Generate(generate_pb2.GenerateRequest(prompt="hi"), metadata=keyed, timeout=10))
        assert [t for r in responses for t in r.token_ids] == [70, 71, 72]
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_grpc_messages_over_max_request_bytes_are_refused_before_they_are_read(frontends):
    channel, stub = grpc_stub(frontends.guarded)
    keyed = (("authorization", f"Bearer {KEY}"),)
    with channel:
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(generate_pb2.GenerateRequest(prompt="a " * MAX_BYTES), metadata=keyed, timeout=10))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        tokens = stub.Tokenize(generate_pb2.TokenizeRequest(text="a " * 1000), metadata=keyed, timeout=10).token_ids
        assert tokens


def test_http_bodies_over_max_request_bytes_get_413_declared_or_chunked(frontends):
    server = frontends.guarded
    big = {"model": "tiny", "prompt": "a " * MAX_BYTES}
    for chunked in (False, True):
        status, headers, raw = request(server, "POST", "/tokenize", big, KEYED, chunked=chunked)
        error = json.loads(raw)["error"]
        assert status == 413 and error["code"] == "request_too_large" and str(MAX_BYTES) in error["message"]
        assert headers.get("connection") == "close"
        small = {"prompt": "a " * 1000}
        status, _, raw = request(server, "POST", "/tokenize", small, KEYED, chunked=chunked)
        assert status == 200 and json.loads(raw)["count"] > 0, raw
    # Without a key the body is not even looked at: 401 before 413.
    assert request(server, "POST", "/tokenize", big)[0] == 401


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """The server closes ``sock`` (reads end) within ``seconds``; whatever it sent first is skipped."""
    sock.settimeout(seconds)
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            if not sock.recv(65536):
                return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
    return False


def connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.http_port), timeout=10)


def test_a_connection_that_sends_no_headers_or_drips_them_is_closed_after_the_header_timeout(frontends):
    server = frontends.guarded
    with connect(server) as silent:
        assert closed_within(silent, HEADER_TIMEOUT + 2)
    with connect(server) as dripping:
        started = time.monotonic()
        for byte in b"GET /health HTTP/1.1\r\nHost: x\r\n":
            try:
                dripping.sendall(bytes([byte]))
            except OSError:
                break
            time.sleep(0.05)
            if time.monotonic() - started > HEADER_TIMEOUT + 2:
                break
        assert closed_within(dripping, 2)
        assert time.monotonic() - started < HEADER_TIMEOUT + 3


def test_an_idle_keep_alive_connection_is_closed_after_the_keep_alive_timeout(frontends):
    with connect(frontends.guarded) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.1)
        assert b"200 OK" in sock.recv(65536)
        started = time.monotonic()
        assert closed_within(sock, KEEP_ALIVE + 2)
        assert time.monotonic() - started >= KEEP_ALIVE * 0.8


def test_past_the_connection_limit_requests_get_503(frontends):
    server = frontends.guarded
    idle = [connect(server) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.1)
        assert request(server, "GET", "/health")[0] == 503
    finally:
        for sock in idle:
            sock.close()
    wait_until(lambda: request(server, "GET", "/health")[0] == 200, timeout=HEADER_TIMEOUT + 5, what="room again")


def test_with_tls_ca_file_both_public_ports_ask_for_a_client_certificate(frontends, pki):
    server = frontends.client_certs
    ca = pathlib.Path(pki.public_ca).read_bytes()
    cert, key = pki.internal.read()
    for client_cert, ok in (((key, cert), True), (None, False), (tuple(reversed(pki.rogue.read())), False)):
        credentials = grpc.ssl_channel_credentials(ca, *(client_cert or (None, None)))
        with grpc.secure_channel(f"127.0.0.1:{server.port}", credentials) as channel:
            stub = generate_pb2_grpc.TextGenerationStub(channel)
            if ok:
                assert stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=10).vocab_size == 300
            else:
                with pytest.raises(grpc.RpcError) as err:
                    stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=10)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        context = ssl.create_default_context(cafile=pki.public_ca)
        if client_cert is not None:
            context.load_cert_chain(
                pki.internal.cert if ok else pki.rogue.cert, pki.internal.key if ok else pki.rogue.key
            )
        conn = http.client.HTTPSConnection("127.0.0.1", server.http_port, timeout=10, context=context)
        try:
            if ok:
                conn.request("GET", "/health")
                assert conn.getresponse().status == 200
            else:
                with pytest.raises((ssl.SSLError, ConnectionError)):
                    conn.request("GET", "/health")
                    conn.getresponse()
        finally:
            conn.close()


def test_a_thousand_idle_connections_are_all_closed_after_the_header_timeout(frontends):
    """The issue's reproduction: 1,000 connections that never send a byte no longer stay open forever."""
    server = frontends.guarded
    idle = [connect(server) for _ in range(1000)]
    try:
        deadline = time.monotonic() + HEADER_TIMEOUT + 10
        still_open = [sock for sock in idle if not closed_within(sock, max(deadline - time.monotonic(), 0.01))]
        assert not still_open, f"{len(still_open)} of 1000 idle connections still open"
    finally:
        for sock in idle:
            sock.close()
    wait_until(lambda: request(server, "GET", "/health")[0] == 200, timeout=HEADER_TIMEOUT + 5, what="room again")
