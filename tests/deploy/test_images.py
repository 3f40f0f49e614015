"""The images built and docker-compose.yml run for real: `make test-images` (podman; CONTAINER_ENGINE=docker: Docker).

docker/build_images.py builds the three images the way compose names them, with this machine's package
setup as build args; then compose starts the frontend and what it depends on, as a user would
(`podman-compose up -d tokenizer`), on free host ports. The checks: /health SERVING, a chat completion
through the official openai client, gRPC health and a Generate on the published port, /metrics and the
image's own health check in all three services, only the frontend published and the internal network
without a route out, the worker on its prebuilt kernels and baked model, and last `down`: a request in
flight finishes and every container exits by itself within its stop_grace_period. Marked slow: the
worker image takes minutes to build.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvgrid.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from services.worker.setup.cpu_features import cpu_flags
from tests.deploy import compose
from tests.procs import free_ports

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

ENGINE = os.environ.get("CONTAINER_ENGINE", "podman")
COMPOSE = ["podman-compose"] if ENGINE == "podman" else [ENGINE, "compose"]
PROJECT = "kvgridimages"
READY_SECONDS = 600
METRICS = {
    "tokenizer": ("8000", "kvgrid_requests_total"),
    "scheduler": ("8002", "kvgrid_num_requests_running"),
    "worker": ("8003", "kvgrid_worker_num_blocks"),
}
GRPC_PORTS = {"tokenizer": 50051, "scheduler": 50052, "worker": 50053}


def _run(*command: str, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)


class Stack:
    """The compose project: its host ports, environment and containers."""

    def __init__(self, log_dir: Path, models_dir: Path):
        self.log_dir = log_dir
        self.grpc_port, self.http_port = free_ports(2)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("KVGRID_", "OTEL_"))}
        self.env |= {
            "KVGRID_TOKENIZER_PORT": str(self.grpc_port),
            "KVGRID_HTTP_PORT": str(self.http_port),
            "KVGRID_MODELS_DIR": str(models_dir),
        }
        self.services = compose.load()["services"]

    def compose(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        command = [*COMPOSE, "-p", PROJECT, "-f", str(compose.COMPOSE_FILE), *args]
        return _run(*command, timeout=timeout, env=self.env, cwd=compose.ROOT)

    def container(self, service: str) -> str:
        project, name = f"label=com.docker.compose.project={PROJECT}", f"label=com.docker.compose.service={service}"
        names = _run(ENGINE, "ps", "-a", "--filter", project, "--filter", name, "--format", "{{.Names}}").stdout
        assert names.split(), f"no container for {service}"
        return names.split()[0]

    def exec(self, service: str, *command: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return _run(ENGINE, "exec", self.container(service), *command, timeout=timeout)

    def logs(self, service: str) -> str:
        proc = _run(ENGINE, "logs", self.container(service))
        return proc.stdout + proc.stderr

    def save_logs(self) -> None:
        for service in compose.KVGRID_SERVICES:
            try:
                (self.log_dir / f"{service}.log").write_text(self.logs(service))
            except (AssertionError, subprocess.SubprocessError):
                pass

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.http_port}{path}"


def _get(url: str, timeout: float = 10) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return 0, str(exc)


def _wait_serving(stack: Stack) -> float:
    started = time.monotonic()
    while time.monotonic() - started < READY_SECONDS:
        status, body = _get(stack.url("/health"), timeout=5)
        if status == 200 and body.strip() == "SERVING":
            return time.monotonic() - started
        time.sleep(2)
    stack.save_logs()
    tails = "\n".join(f"--- {s}\n{stack.logs(s)[-3000:]}" for s in compose.KVGRID_SERVICES)
    pytest.fail(f"/health not SERVING {READY_SECONDS} s after `up -d` (last: {status} {body!r})\n{tails}")


def _remove_project() -> None:
    """Whatever an earlier or failed run left: containers of the project, then its networks."""
    ids = _run(ENGINE, "ps", "-aq", "--filter", f"label=com.docker.compose.project={PROJECT}").stdout.split()
    if ids:
        _run(ENGINE, "rm", "-f", "-t", "0", *ids)
    for network in compose.load()["networks"]:
        _run(ENGINE, "network", "rm", f"{PROJECT}_{network}")


def _grace(stack: Stack) -> str:
    """`down -t`: the longest stop_grace_period (podman-compose 1.0 reads no stop_grace_period itself)."""
    return str(int(max(compose.seconds(stack.services[s]["stop_grace_period"]) for s in compose.KVGRID_SERVICES)))


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    missing = [tool for tool in (ENGINE, COMPOSE[0]) if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed: run `make test-images` as root (it installs them with apt)")
    log_dir = tmp_path_factory.mktemp("images")
    stack = Stack(log_dir, tmp_path_factory.mktemp("models"))
    _remove_project()
    with open(log_dir / "build.log", "w") as log:
        build = subprocess.run(
            [sys.executable, str(compose.ROOT / "docker/build_images.py"), "--engine", ENGINE],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=compose.ROOT,
            timeout=3000,
        )
    summary = [line for line in (log_dir / "build.log").read_text().splitlines() if line.startswith("build_images:")]
    print("\n".join(summary))
    assert build.returncode == 0, (log_dir / "build.log").read_text()[-5000:]
    try:
        up = stack.compose("up", "-d", "--no-build", "tokenizer")
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        print(f"/health SERVING {_wait_serving(stack):.0f} s after `up -d`")
        yield stack
    finally:
        stack.save_logs()
        stack.compose("down", "-t", _grace(stack), timeout=600)
        _remove_project()


def test_health_is_serving_on_the_published_http_port(stack):
    assert _get(stack.url("/health")) == (200, "SERVING\n")


def test_a_chat_completion_through_the_openai_client(stack):
    from openai import OpenAI

    client = OpenAI(base_url=stack.url("/v1"), api_key="unused", timeout=120)
    (model,) = [m.id for m in client.models.list().data]
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=12,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.content.strip(), reply
    assert 0 < reply.usage.completion_tokens <= 12


def test_grpc_health_and_a_generate_on_the_published_port(stack):
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        request = generate_pb2.GenerateRequest(
            prompt="The capital of France is", sampling=common_pb2.SamplingParams(max_tokens=8), request_id="images-1"
        )
        replies = list(generate_pb2_grpc.TextGenerationStub(channel).Generate(request, timeout=120))
    assert replies[-1].finish_reason in ("stop", "length")
    assert 0 < replies[-1].usage.completion_tokens == sum(len(r.token_ids) for r in replies) <= 8
    assert "".join(r.text for r in replies).strip()


@pytest.mark.parametrize("service", compose.KVGRID_SERVICES)
def test_each_service_answers_its_image_health_check_and_serves_metrics(stack, service):
    """From inside the frontend's container: the scheduler and the worker are reachable only there."""
    check = stack.exec(service, "python", "-m", "kvgrid.cli.healthcheck", f"localhost:{GRPC_PORTS[service]}")
    assert check.returncode == 0, check.stdout + check.stderr
    port, metric = METRICS[service]
    url = f"http://{service}:{port}/metrics"
    fetch = f"import urllib.request as u; print(u.urlopen('{url}', timeout=10).read().decode())"
    proc = stack.exec("tokenizer", "python", "-c", fetch)
    assert proc.returncode == 0, proc.stderr
    assert metric in proc.stdout, f"{service}:{port}/metrics lacks {metric}"


def test_only_the_frontend_is_published_and_the_internal_network_has_no_route_out(stack):
    published = {s: _run(ENGINE, "port", stack.container(s)).stdout.split() for s in compose.KVGRID_SERVICES}
    assert published["scheduler"] == published["worker"] == []
    assert any(p.endswith(f":{stack.grpc_port}") for p in published["tokenizer"]), published
    assert any(p.endswith(f":{stack.http_port}") for p in published["tokenizer"]), published
    outside = socket.gethostbyname("deb.debian.org")  # an address this host reaches (the images' apt mirror)
    socket.create_connection((outside, 80), timeout=10).close()
    dial = f"import socket; socket.create_connection(('{outside}', 80), timeout=5)"
    assert stack.exec("worker", "python", "-c", dial).returncode != 0, "the worker reaches the outside"


def test_the_worker_runs_the_prebuilt_kernels_and_the_model_converted_at_build_time(stack):
    log = stack.logs("worker")
    # the cache entry baked into the image is read: nothing converted again, nothing refused
    assert "Permission denied" not in log and "cannot cache" not in log and " once into " not in log, log[-3000:]
    if {"avx2", "fma"} <= cpu_flags():
        assert "steps run on the native CPU kernels" in log, log[-3000:]
    user = stack.exec("worker", "id", "-u")
    assert user.stdout.strip() == "10001"


def _stream(stack: Stack, max_tokens: int, arrivals: list[float], errors: list, started: threading.Event) -> None:
    """A greedy Generate of exactly max_tokens; the monotonic time each reply arrives goes into ``arrivals``."""
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    request = generate_pb2.GenerateRequest(prompt="Count:", sampling=sampling)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
            for reply in generate_pb2_grpc.TextGenerationStub(channel).Generate(request, timeout=300):
                arrivals.append(time.monotonic())
                started.set()
                if reply.finish_reason:
                    assert (reply.finish_reason, reply.usage.completion_tokens) == ("length", max_tokens), reply
    except (grpc.RpcError, AssertionError) as exc:
        errors.append(exc)
    started.set()


def _follow(name: str, lines: list[tuple[float, str]]) -> subprocess.Popen:
    """`logs -f` of a container, each line with the time it was read; ends when the container does."""
    proc = subprocess.Popen([ENGINE, "logs", "-f", name], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def read() -> None:
        for line in proc.stdout:
            lines.append((time.monotonic(), line))

    threading.Thread(target=read, daemon=True).start()
    return proc


def test_down_drains_a_request_in_flight_and_every_container_exits_by_itself(stack):
    """Runs last. compose stops the frontend first: a stream it is serving still finishes after SIGTERM, then
    each container exits by itself (never SIGKILLed after its stop_grace_period)."""
    # a request of about 8 s at the rate measured now: it spans SIGTERM, and ends well within the 30 s grace
    arrivals, errors, started = [], [], threading.Event()
    _stream(stack, 32, arrivals, errors, started)
    assert not errors, errors
    max_tokens = max(32, min(1024, int(8 * 31 / max(arrivals[-1] - arrivals[0], 1e-3))))

    exits: dict[str, str] = {}

    def wait(service: str, name: str) -> None:
        exits[service] = _run(ENGINE, "wait", name, timeout=600).stdout.strip()

    names = {service: stack.container(service) for service in compose.KVGRID_SERVICES}
    waiters = [threading.Thread(target=wait, args=item, daemon=True) for item in names.items()]
    for thread in waiters:
        thread.start()
    stack.save_logs()
    log: list[tuple[float, str]] = []
    follower = _follow(names["tokenizer"], log)
    arrivals, errors, started = [], [], threading.Event()
    client = threading.Thread(target=_stream, args=(stack, max_tokens, arrivals, errors, started), daemon=True)
    client.start()
    assert started.wait(120) and not errors, errors
    begun = time.monotonic()
    down = stack.compose("down", "-t", _grace(stack), timeout=600)
    took = time.monotonic() - begun
    client.join(60)
    for thread in waiters:
        thread.join(60)
    follower.wait(60)
    assert down.returncode == 0, down.stdout[-2000:] + down.stderr[-2000:]
    assert not errors, f"the request in flight failed during `down`: {errors}"
    draining = [at for at, line in log if "shutting down: NOT_SERVING" in line]
    text = "".join(line for _, line in log)
    assert draining, f"the tokenizer never logged its shutdown:\n{text[-3000:]}"
    after = sum(at > draining[0] for at in arrivals)
    assert after > 0, f"all {max_tokens} tokens came before SIGTERM: nothing was drained"
    assert "still running after" not in text, text[-3000:]
    killed = {s: code for s, code in exits.items() if code not in ("0", "143")}
    assert len(exits) == 3 and not killed, f"exit codes {exits} (137: killed after the grace); `down` took {took:.0f} s"
