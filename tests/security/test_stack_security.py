"""A whole `kvgrid serve` stack with API keys, TLS on its public ports and mutual TLS between its services.

One stack of real processes (a tiny float32 model, so it starts in seconds) on `--host 0.0.0.0`: the official
`openai` client (trusting the CA) and gRPC clients get in with a key and are refused (401 / UNAUTHENTICATED)
without one or with a wrong one; plaintext clients fail against the TLS ports; a peer without a certificate of the
internal CA cannot call Worker.Handshake, Worker.Execute or Scheduler.Connect; the scheduler and the worker listen
on loopback only; the key is on no child's command line; the CLI clients take the key and the CA.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import socket
import ssl
import subprocess
import sys

import grpc
import httpx2
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvgrid.v1 import generate_pb2, generate_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.e2e.stack import child_env, running_stack
from tests.security.certs import Pki
from tests.worker.tiny import save_tiny_bytelevel_tokenizer, save_tiny_model

pytestmark = pytest.mark.timeout(300)

KEYS = ("kvgrid-test-key-one", "kvgrid-test-key-two")  # the first by --api-key, the second from --api-key-file
WRONG = "kvgrid-test-key-onf"
INTERNAL_PORTS = ("--scheduler-port", "--scheduler-metrics-port", "--worker-port", "--worker-metrics-port")
PUBLIC_PORTS = ("--tokenizer-port", "--http-port")


@pytest.fixture(scope="module")
def stack(tmp_path_factory, pki: Pki):
    tmp = tmp_path_factory.mktemp("secure-stack")
    model = str(tmp / "tiny")
    save_tiny_model(model, vocab_size=300, max_position_embeddings=256)  # the byte-level tokenizer has 263 ids
    save_tiny_bytelevel_tokenizer(model)
    key_file = tmp / "keys.txt"
    key_file.write_text(f"# one key per line\n{KEYS[1]}\n")
    args = ["--host", "0.0.0.0", "--model", model, "--dtype", "float32", "--device", "cpu"]
    args += ["--kv-cache-memory", "4MiB", "--api-key", KEYS[0], "--api-key-file", str(key_file)]
    args += ["--metrics-require-key", *pki.public_flags(), *pki.internal_flags()]
    with running_stack(tmp / "serve.log", args) as running:
        yield running


def tls(pki: Pki) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=pki.public_ca)


def base_url(stack) -> str:
    return f"https://127.0.0.1:{stack.ports['--http-port']}"


def openai_client(stack, pki: Pki, key: str) -> openai.OpenAI:
    http = httpx2.Client(verify=tls(pki), timeout=60)
    return openai.OpenAI(base_url=base_url(stack) + "/v1", api_key=key, http_client=http, max_retries=0)


def public_channel(stack, pki: Pki) -> grpc.Channel:
    credentials = grpc.ssl_channel_credentials(pathlib.Path(pki.public_ca).read_bytes())
    return grpc.secure_channel(stack.addr, credentials)


def bearer(key: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {key}"),)


def test_the_openai_client_with_the_ca_and_a_key_completes_unary_and_streaming(stack, pki):
    for key in KEYS:
        with openai_client(stack, pki, key) as client:
            model = client.models.list().data[0].id
            out = client.completions.create(model=model, prompt="hello", max_tokens=4, temperature=0)
            assert out.usage.completion_tokens >= 1 and out.choices[0].finish_reason in ("stop", "length")
            chunks = list(client.completions.create(model=model, prompt="hi", max_tokens=3, stream=True))
            assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_http_without_or_with_a_wrong_key_is_401_with_openai_s_error_object(stack, pki):
    with openai_client(stack, pki, WRONG) as client:
        for call in (
            lambda c: c.models.list(),
            lambda c: c.completions.create(model="m", prompt="hello", max_tokens=2),
            lambda c: list(c.completions.create(model="m", prompt="hello", max_tokens=2, stream=True)),
            lambda c: c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}]),
        ):
            with pytest.raises(openai.AuthenticationError) as err:
                call(client)
            assert err.value.status_code == 401
            assert err.value.body["code"] == "invalid_api_key" and err.value.body["type"] == "invalid_request_error"
    body = {"model": "m", "prompt": "hello", "max_tokens": 2, "stream": True}
    with httpx2.Client(base_url=base_url(stack), verify=tls(pki), timeout=30) as http:
        routes = [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")]
        routes += [("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/openapi.json")]
        for method, path in routes:
            for headers in ({}, {"Authorization": f"Bearer {WRONG}"}, {"Authorization": KEYS[0]}):
                reply = http.request(method, path, headers=headers, json={**body, "tokens": [1]})
                assert reply.status_code == 401, (path, headers)
                error = reply.json()["error"]
                assert error["code"] == "invalid_api_key" and KEYS[0] not in reply.text
        key = {"Authorization": f"Bearer {KEYS[1]}"}
        assert http.post("/tokenize", headers=key, json={"prompt": "hello"}).json()["count"] > 0
        schema = http.get("/openapi.json", headers=key).json()
        assert "/v1/chat/completions" in schema["paths"] and "/v1/completions" in schema["paths"]
        # /health stays open; /metrics wants a key here (--metrics-require-key)
        assert http.get("/health").status_code == 200
        assert http.get("/metrics").status_code == 401
        assert "kvgrid_requests_total" in http.get("/metrics", headers=key).text


def test_grpc_without_or_with_a_wrong_key_is_unauthenticated_unary_and_streaming(stack, pki):
    with public_channel(stack, pki) as channel:
        stub = generate_pb2_grpc.TextGenerationStub(channel)
        request = generate_pb2.GenerateRequest(prompt="hello", sampling={"max_tokens": 3})
        for metadata in ((), bearer(WRONG), (("authorization", KEYS[0]),)):
            with pytest.raises(grpc.RpcError) as err:
                stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), metadata=metadata, timeout=30)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(request, metadata=metadata, timeout=30))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and KEYS[0] not in err.value.details()
        for key in KEYS:
            info = stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), metadata=bearer(key), timeout=30)
            assert info.vocab_size == 300
            responses = list(stub.Generate(request, metadata=bearer(key), timeout=60))
            assert responses[-1].finish_reason in ("stop", "length") and responses[-1].usage.completion_tokens >= 1
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert health.status == health_pb2.HealthCheckResponse.SERVING  # no key needed


def test_plaintext_clients_fail_against_the_tls_ports(stack):
    with grpc.insecure_channel(stack.addr) as channel:
        stub = generate_pb2_grpc.TextGenerationStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), metadata=bearer(KEYS[0]), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(httpx2.HTTPError):
        httpx2.get(f"http://127.0.0.1:{stack.ports['--http-port']}/health", timeout=10)


def internal_channel(addr: str, pki: Pki, client_cert: tuple[bytes, bytes] | None) -> grpc.Channel:
    """A TLS channel trusting the internal CA (so only the client's certificate decides), or plaintext when
    ``client_cert`` is "plaintext"."""
    ca = pathlib.Path(pki.internal_ca).read_bytes()
    key, cert = (client_cert[1], client_cert[0]) if client_cert else (None, None)
    return grpc.secure_channel(addr, grpc.ssl_channel_credentials(ca, private_key=key, certificate_chain=cert))


def internal_calls(stack) -> dict:
    worker, scheduler = (f"127.0.0.1:{stack.ports[p]}" for p in ("--worker-port", "--scheduler-port"))
    return {
        "Worker.Handshake": (
            worker,
            lambda ch: worker_pb2_grpc.WorkerStub(ch).Handshake(worker_pb2.HandshakeRequest(), timeout=10),
        ),
        "Worker.Execute": (
            worker,
            lambda ch: list(worker_pb2_grpc.WorkerStub(ch).Execute(iter([worker_pb2.StepPlan()]), timeout=10)),
        ),
        "Scheduler.Connect": (
            scheduler,
            lambda ch: list(scheduler_pb2_grpc.SchedulerStub(ch).Connect(iter([]), timeout=10)),
        ),
        "Scheduler.Submit": (
            scheduler,
            lambda ch: list(
                scheduler_pb2_grpc.SchedulerStub(ch).Submit(
                    scheduler_pb2.SubmitRequest(prompt_token_ids=[1]), timeout=10
                )
            ),
        ),
    }


def test_a_peer_without_a_certificate_of_the_internal_ca_is_refused_at_the_tls_handshake(stack, pki):
    for name, (addr, call) in internal_calls(stack).items():
        for how, channel in (
            ("plaintext", grpc.insecure_channel(addr)),
            ("no client certificate", internal_channel(addr, pki, None)),
            ("another CA's certificate", internal_channel(addr, pki, pki.rogue.read())),
        ):
            with channel, pytest.raises(grpc.RpcError) as err:
                call(channel)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, (name, how, err.value)


def test_a_peer_with_a_valid_certificate_gets_no_second_plan_stream_beside_the_scheduler_s(stack, pki):
    addr, _ = internal_calls(stack)["Worker.Handshake"]
    with internal_channel(addr, pki, pki.internal.read()) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        assert stub.Handshake(worker_pb2.HandshakeRequest(scheduler_id="intruder"), timeout=10).num_blocks > 0
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Execute(iter([worker_pb2.StepPlan(step_id=1)]), timeout=30))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "another plan stream is open" in err.value.details()


def listening(port: int) -> set[str]:
    """The local addresses with a TCP socket listening on ``port`` (from /proc/net/tcp and tcp6)."""
    found = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        if not os.path.exists(table):
            continue
        for line in pathlib.Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state = fields[1], fields[3]
            address, hex_port = local.split(":")
            if state != "0A" or int(hex_port, 16) != port:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(address)
            if width == 8:
                found.add(socket.inet_ntop(socket.AF_INET, raw[::-1]))
            else:  # four little-endian 32-bit words
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                found.add(socket.inet_ntop(socket.AF_INET6, words).removeprefix("::ffff:"))  # v4-mapped: v4
    return found


def non_loopback_ipv4() -> str | None:
    """An address of this machine that is not loopback (the one its default route would use), if any."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: no packet is sent for a UDP connect
        except OSError:
            return None
        ip = probe.getsockname()[0]
    return None if ip.startswith("127.") or ip == "0.0.0.0" else ip


def test_under_serve_the_scheduler_and_the_worker_listen_on_loopback_only(stack):
    for flag in INTERNAL_PORTS:
        assert listening(stack.ports[flag]) == {"127.0.0.1"}, flag
    for flag in PUBLIC_PORTS:
        assert listening(stack.ports[flag]) and listening(stack.ports[flag]) <= {"0.0.0.0", "::"}, flag
    ip = non_loopback_ipv4()
    if ip is not None:
        for flag in INTERNAL_PORTS:
            with pytest.raises(OSError):
                socket.create_connection((ip, stack.ports[flag]), timeout=5).close()
        socket.create_connection((ip, stack.ports["--http-port"]), timeout=5).close()


def test_the_key_is_on_no_command_line_and_reaches_the_frontend_alone(stack):
    for name, pid in stack.child_pids.items():
        argv = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
        assert KEYS[0].encode() not in argv and b"--api-key\0" not in argv, name
        environ = pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert (f"KVGRID_API_KEY={KEYS[0]}".encode() in environ) == (name == "tokenizer"), name
    assert KEYS[0] not in stack.log() and KEYS[1] not in stack.log()


def test_each_service_says_what_it_binds_and_how_it_is_protected(stack):
    log, ports = stack.log(), stack.ports
    assert f"worker gRPC on 127.0.0.1:{ports['--worker-port']} (mutual TLS" in log
    assert f"worker /metrics on 127.0.0.1:{ports['--worker-metrics-port']}" in log
    assert f"scheduler serving on 127.0.0.1:{ports['--scheduler-port']} (mutual TLS)" in log
    assert f"scheduler /metrics on 127.0.0.1:{ports['--scheduler-metrics-port']}" in log
    public = f"gRPC {ports['--tokenizer-port']}, HTTP {ports['--http-port']} (TLS; API key required (2 accepted"
    assert f"tokenizer frontend on 0.0.0.0: {public}" in log
    assert re.search(r"schedulers at 127\.0\.0\.1:\d+ \(.*; mutual TLS\)", log)
    assert f"grpcs://127.0.0.1:{ports['--tokenizer-port']}" in log and "loopback only; mutual TLS" in log


def kvgrid(*argv: str, key: str | None) -> subprocess.CompletedProcess:
    env = child_env() | ({"KVGRID_API_KEY": key} if key else {})
    return subprocess.run(
        [sys.executable, "-m", "kvgrid.cli", *argv], capture_output=True, text=True, timeout=120, env=env
    )


def test_the_cli_clients_take_the_key_and_the_ca(stack, pki):
    generate = ["generate", "hello", "--raw", "--addr", stack.addr, "--max-tokens", "3"]
    done = kvgrid(*generate, "--ca-file", pki.public_ca, key=KEYS[1])
    assert done.returncode == 0, done.stderr
    done = kvgrid(*generate, "--ca-file", pki.public_ca, "--api-key", KEYS[0], key=None)
    assert done.returncode == 0, done.stderr
    refused = kvgrid(*generate, "--ca-file", pki.public_ca, key=None)
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr, refused.stderr
    plaintext = kvgrid(*generate, key=KEYS[0])
    assert plaintext.returncode == 1 and "Traceback" not in plaintext.stderr, plaintext.stderr
    bench = ["bench", "--addr", stack.addr, "-n", "2", "--input-len", "4", "--output-len", "2", "--json"]
    done = kvgrid(*bench, "--ca-file", pki.public_ca, key=KEYS[0])
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["completed"] == 2
