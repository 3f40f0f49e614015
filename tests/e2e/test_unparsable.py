"""Messages that cannot be parsed (a corrupt protobuf, invalid UTF-8 in a string field) answer INVALID_ARGUMENT
with one short line, on every method kind of every service of the real stack, and leave it healthy."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2

from kvgrid.v1 import generate_pb2, scheduler_pb2, worker_pb2
from tests.e2e.stack import get_stats

pytestmark = pytest.mark.timeout(300)

MARK = "MARK"
BAD_UTF8 = b"\xff\xfe\xfd\xfc"
CORRUPT = b"\x0a\x40abc"  # field 1 claims 64 bytes, 3 follow

# (service port flag, method path, kind, a message whose string field holds MARK)
METHODS = [
    (
        "--tokenizer-port",
        "/kvgrid.v1.TextGeneration/Generate",
        "unary_stream",
        generate_pb2.GenerateRequest(prompt=MARK),
    ),
    ("--tokenizer-port", "/kvgrid.v1.TextGeneration/Tokenize", "unary_unary", generate_pb2.TokenizeRequest(text=MARK)),
    ("--scheduler-port", "/kvgrid.v1.Scheduler/Submit", "unary_stream", scheduler_pb2.SubmitRequest(request_id=MARK)),
    ("--scheduler-port", "/kvgrid.v1.Scheduler/Abort", "unary_unary", scheduler_pb2.AbortRequest(request_id=MARK)),
    ("--worker-port", "/kvgrid.v1.Worker/Handshake", "unary_unary", worker_pb2.HandshakeRequest(scheduler_id=MARK)),
    ("--worker-port", "/kvgrid.v1.Worker/Execute", "stream_stream", worker_pb2.StepPlan(finished_ids=[MARK])),
    ("--worker-port", "/grpc.health.v1.Health/Check", "unary_unary", health_pb2.HealthCheckRequest(service=MARK)),
]


def call(channel: grpc.Channel, method: str, kind: str, payload: bytes):
    identity = {"request_serializer": None, "response_deserializer": None}
    if kind == "unary_unary":
        return channel.unary_unary(method, **identity)(payload, timeout=30)
    if kind == "unary_stream":
        return list(channel.unary_stream(method, **identity)(payload, timeout=30))
    return list(channel.stream_stream(method, **identity)(iter([payload]), timeout=30))


@pytest.mark.parametrize("flag,method,kind,message", METHODS, ids=[m[1].rsplit("/", 1)[1] for m in METHODS])
@pytest.mark.parametrize("damage", ["corrupt", "bad-utf8"])
def test_unparsable_requests_answer_invalid_argument(fp32_stack, flag, method, kind, message, damage):
    payload = message.SerializeToString()
    payload = CORRUPT if damage == "corrupt" else payload.replace(MARK.encode(), BAD_UTF8)
    with grpc.insecure_channel(f"127.0.0.1:{fp32_stack.ports[flag]}") as channel, pytest.raises(grpc.RpcError) as e:
        call(channel, method, kind, payload)
    details = e.value.details()
    if method.endswith("/Execute"):
        # Only the scheduler that handshook may open the plan stream: a stranger is refused before its first
        # message is read, so what it sends is never parsed.
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION, details
        assert "Handshake" in details and "\n" not in details
        return
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, details
    assert details.startswith(f"{method}: the request cannot be parsed") and "\n" not in details
    assert ("bad UTF-8" if damage == "bad-utf8" else "corrupt") in details


def test_the_stack_serves_after_unparsable_requests(fp32_stack, channel, scheduler_channel):
    from kvgrid.v1 import generate_pb2_grpc

    stub = generate_pb2_grpc.TextGenerationStub(channel)
    ids = [t for r in stub.Generate(generate_pb2.GenerateRequest(prompt="Hi"), timeout=120) for t in r.token_ids]
    assert ids and get_stats(scheduler_channel).worker_ready
