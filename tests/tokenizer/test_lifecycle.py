"""Frontend startup, scheduler loss and return, the --tokenizer override, the process itself (no torch)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvgrid.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from services.common.server import SERVING
from tests.procs import free_port
from tests.tokenizer.conftest import LoopThread, frontend_config, handshake, wait_until
from tests.tokenizer.fake_scheduler import Script, start_fake_scheduler

pytestmark = pytest.mark.timeout(180)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HI = [generate_pb2.ChatMessage(role="user", content="hi")]


def with_template(files: dict[str, bytes], template: str) -> dict[str, bytes]:
    return dict(files, **{"chat_template.jinja": template.encode()})


def rendered_chat(stub) -> str:
    token_ids = stub.Tokenize(generate_pb2.TokenizeRequest(messages=HI), timeout=5).token_ids
    return stub.Detokenize(generate_pb2.DetokenizeRequest(token_ids=token_ids), timeout=5).text


@pytest.fixture
def loop():
    thread = LoopThread()
    yield thread
    thread.close()


def health_status(channel) -> int:
    request = health_pb2.HealthCheckRequest(service="kvgrid.v1.TextGeneration")
    return health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status


def test_waits_for_the_scheduler_follows_its_loss_and_a_new_worker(loop, smollm):
    from services.tokenizer.server import start_tokenizer

    port = free_port()
    frontend = loop.run(start_tokenizer(frontend_config(f"127.0.0.1:{port}")))
    channel = grpc.insecure_channel(f"127.0.0.1:{frontend.port}")
    stub = generate_pb2_grpc.TextGenerationStub(channel)
    try:
        assert health_status(channel) != SERVING
        for call in (
            lambda: list(stub.Generate(generate_pb2.GenerateRequest(prompt="hi"), timeout=5)),
            lambda: stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=5),
            lambda: stub.Tokenize(generate_pb2.TokenizeRequest(text="hi"), timeout=5),
        ):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE

        first = handshake(with_template(smollm.files, "A:{{ messages[0]['content'] }}"), worker_id="w-1")
        server, fake, _, _ = loop.run(start_fake_scheduler(first, port=port))
        wait_until(lambda: health_status(channel) == SERVING, timeout=20, what="SERVING after the scheduler came up")
        assert stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=5).num_kv_blocks == 123
        assert rendered_chat(stub) == "A:hi"

        loop.run(server.stop(0))
        wait_until(lambda: health_status(channel) != SERVING, timeout=20, what="NOT_SERVING without a scheduler")
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(generate_pb2.GenerateRequest(prompt="hi"), timeout=5))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE

        second = handshake(with_template(smollm.files, "B:{{ messages[0]['content'] }}"), worker_id="w-2")
        second.num_blocks = 77
        server, fake, _, _ = loop.run(start_fake_scheduler(second, port=port))
        wait_until(lambda: health_status(channel) == SERVING, timeout=20, what="SERVING after the restart")
        assert stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=5).num_kv_blocks == 77
        assert rendered_chat(stub) == "B:hi"
        loop.run(server.stop(0))
    finally:
        channel.close()
        loop.run(frontend.stop(0))


def test_tokenizer_flag_overrides_the_workers_files(loop, smollm, tmp_path):
    from services.tokenizer.server import start_tokenizer

    for name, data in with_template(smollm.files, "MINE:{{ messages[0]['content'] }}").items():
        (tmp_path / name).write_bytes(data)
    server, fake, _, port = loop.run(start_fake_scheduler(handshake(smollm.files)))
    frontend = loop.run(start_tokenizer(frontend_config(f"127.0.0.1:{port}", tokenizer=str(tmp_path))))
    channel = grpc.insecure_channel(f"127.0.0.1:{frontend.port}")
    try:
        stub = generate_pb2_grpc.TextGenerationStub(channel)
        assert rendered_chat(stub) == "MINE:hi"
        wait_until(lambda: frontend.state.serving, what="the frontend to serve")
        assert rendered_chat(stub) == "MINE:hi"
    finally:
        channel.close()
        loop.run(frontend.stop(0))
        loop.run(server.stop(0))


def test_bad_tokenizer_files_keep_the_frontend_not_serving(loop, smollm):
    from services.tokenizer.server import start_tokenizer

    broken = handshake({"tokenizer_config.json": json.dumps({}).encode()})
    server, fake, _, port = loop.run(start_fake_scheduler(broken))
    frontend = loop.run(start_tokenizer(frontend_config(f"127.0.0.1:{port}")))
    try:
        wait_until(lambda: fake.info_calls >= 2, timeout=20, what="GetWorkerInfo to be retried")
        assert not frontend.state.serving
    finally:
        loop.run(frontend.stop(0))
        loop.run(server.stop(0))


def test_the_frontend_never_imports_torch_or_transformers(smollm):
    code = textwrap.dedent(f"""
        import asyncio, sys
        from services.common.config import Config, ModelConfig, NetworkConfig, ObservabilityConfig, SchedulerConfig
        from services.tokenizer.server import start_tokenizer

        async def run():
            config = Config(ModelConfig(tokenizer={smollm.dir!r}), scheduler=SchedulerConfig(),
                            observability=ObservabilityConfig(),
                            network=NetworkConfig(host="127.0.0.1", scheduler_addr="127.0.0.1:1"))
            server = await start_tokenizer(config)
            assert server.state.tokenizer.encode("hello") == [28120]
            await asyncio.sleep(0.3)
            await server.stop(0)

        asyncio.run(run())
        heavy = sorted(m for m in ("torch", "transformers") if m in sys.modules)
        print("HEAVY", heavy)
        sys.exit(1 if heavy else 0)
    """)
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "HEAVY []" in result.stdout


def test_kvgrid_tokenizer_command_serves_traces_and_stops_on_sigterm(loop, smollm):
    from tests.observability.otlp_collector import OtlpCollector

    server, fake, _, port = loop.run(start_fake_scheduler(handshake(smollm.files)))
    fake.script = Script(deltas=[[28120]], finish=common_pb2.FINISH_REASON_LENGTH)
    grpc_port, http_port = free_port(), free_port()
    command = [sys.executable, "-m", "kvgrid.cli", "tokenizer", "--host", "127.0.0.1"]
    command += [
        "--tokenizer-port",
        str(grpc_port),
        "--http-port",
        str(http_port),
        "--scheduler-addr",
        f"127.0.0.1:{port}",
    ]
    with OtlpCollector() as collector:
        env = dict(os.environ, **collector.env())
        process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        try:
            channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
            grpc.channel_ready_future(channel).result(timeout=60)
            wait_until(lambda: health_status(channel) == SERVING, timeout=60, what="the command to serve")
            assert urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=5).status == 200
            stub = generate_pb2_grpc.TextGenerationStub(channel)
            request = generate_pb2.GenerateRequest(prompt="hi", request_id="traced-1")
            assert "".join(r.text for r in stub.Generate(request, timeout=30)) == "hello"
            metrics = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=5).read().decode()
            assert 'kvgrid_requests_total{model="SmolLM2-135M-Instruct",status="length"} 1.0' in metrics
            channel.close()
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=30) == 0
        finally:
            if process.poll() is None:
                process.kill()
            output = process.communicate()[0]
            loop.run(server.stop(0))
        assert "shutting down" in output
        spans = [s for s in collector.spans() if s.name == "tokenizer.generate"]
    assert len(spans) == 1, output
    span = spans[0]
    assert span.service == "kvgrid-tokenizer" and span.attributes["kvgrid.request_id"] == "traced-1"
    # The Submit call carried this span's context: the scheduler's span will be its child.
    assert fake.submits[-1].trace_context["traceparent"].split("-")[1:3] == [span.trace_id, span.span_id]
