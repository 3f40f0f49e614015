"""The frontend's Connect stream breaking: calls in flight fail with UNAVAILABLE, then the frontend dials again."""

from __future__ import annotations

import grpc
import pytest

from kvgrid.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from services.tokenizer.server import start_tokenizer
from tests.tokenizer.conftest import LoopThread, frontend_config, handshake, wait_until
from tests.tokenizer.fake_scheduler import Script, start_fake_scheduler

pytestmark = pytest.mark.timeout(120)


def test_a_broken_scheduler_stream_fails_calls_in_flight_and_the_frontend_reconnects(smollm):
    loop = LoopThread()
    server, fake, _, port = loop.run(start_fake_scheduler(handshake(smollm.files)))
    frontend = loop.run(start_tokenizer(frontend_config(f"127.0.0.1:{port}")))
    channel = grpc.insecure_channel(f"127.0.0.1:{frontend.port}")
    try:
        wait_until(lambda: frontend.state.serving, what="the frontend to serve")
        stub = generate_pb2_grpc.TextGenerationStub(channel)
        fake.script = Script(deltas=[[504], [3575]], hang=True)
        calls = [
            stub.Generate(generate_pb2.GenerateRequest(prompt="hi", request_id=f"h{i}"), timeout=60) for i in range(3)
        ]
        for call in calls:
            assert next(call).token_ids  # streaming
        loop.run(server.stop(None))  # the scheduler goes away: the stream breaks
        for call in calls:
            with pytest.raises(grpc.RpcError) as err:
                list(call)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "stream to the scheduler" in err.value.details()

        server, fake, _, _ = loop.run(start_fake_scheduler(handshake(smollm.files), port=port))
        fake.script = Script(deltas=[[504]], finish=common_pb2.FINISH_REASON_LENGTH)
        wait_until(lambda: fake.num_connects == 1 and frontend.state.serving, timeout=30, what="a new stream")
        responses = list(stub.Generate(generate_pb2.GenerateRequest(prompt="hi", request_id="h0"), timeout=60))
        assert responses[-1].finish_reason == "length" and [r.request_id for r in fake.submits] == ["h0"]
    finally:
        channel.close()
        loop.run(frontend.stop(0))
        loop.run(server.stop(0))
        loop.close()
