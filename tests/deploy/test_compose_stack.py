"""docker-compose.yml's own commands, variables, ports and health checks, run as local processes.

Each kvgrid service of the compose file starts with its `command` and `environment` (variables
interpolated as compose would with an empty shell), its ports moved to free local ports and peer host
names replaced by 127.0.0.1, in `depends_on` order but without waiting for the one before to be healthy
(`condition: service_started`, as under podman, which runs no health checks): each retries its link
until the next answers, and all three pass their compose health checks.
Then a Generate goes through the tokenizer, and every Prometheus target of docker/prometheus/prometheus.yml
serves kvgrid metrics. Deliberate differences from the containers: KVGRID_MODEL is dropped so the locally
installed default model is used (the image's path differs), the KV cache and model length are small, float32.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml

from kvgrid.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.deploy import compose
from tests.procs import free_port

pytestmark = pytest.mark.timeout(900)

# the only overrides of the compose values, for speed on a small shared CPU: a 64 MiB cache holds
# 1024-token sequences of the default model in float32 (~0.7 MB per 16-token block)
OVERRIDES = {
    "KVGRID_HOST": "127.0.0.1",
    "KVGRID_KV_CACHE_MEMORY": "64MiB",
    "KVGRID_MAX_MODEL_LEN": "1024",
    "KVGRID_DTYPE": "float32",
}
DROPPED = ("KVGRID_MODEL",)


def _base_environ() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVGRID_", "OTEL_"))}
    env["HF_HUB_OFFLINE"] = "1"
    return env


def _tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


class LocalStack:
    def __init__(self, log_dir: Path):
        self.doc = compose.load()
        self.services = self.doc["services"]
        self.port_map = {
            (name, port): free_port()
            for name in compose.KVGRID_SERVICES
            for port in compose.container_ports(self.services[name])
        }
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}

    def logs(self, name: str) -> str:
        return _tail(self.log_dir / f"{name}.log")

    def start(self, name: str) -> None:
        service = self.services[name]
        command = service["command"]
        assert command[0] == "kvgrid", f"{name}: command {command} does not run the kvgrid CLI"
        env = compose.localize(self.services, self.port_map, name, compose.environment(service))
        for key in DROPPED:
            env.pop(key, None)
        env.update(OVERRIDES)
        log = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "kvgrid.cli", *command[1:]],
            env=_base_environ() | env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=compose.ROOT,
        )

    def wait_healthy(self, name: str) -> None:
        """Run the compose health check until it passes, within start_period + retries * interval."""
        check = self.services[name]["healthcheck"]
        assert check["test"][0] == "CMD", f"{name}: health check must be exec form, got {check['test']}"
        args = compose.localize_args(check["test"][1:], self.port_map, name)
        assert args[0] == "python", f"{name}: health check runs {args[0]}, not the image's python"
        args[0] = sys.executable
        interval = compose.seconds(check["interval"])
        deadline = time.monotonic() + compose.seconds(check["start_period"]) + check["retries"] * interval
        while True:
            proc = self.procs[name]
            if proc.poll() is not None:
                pytest.fail(f"{name} exited with {proc.returncode} before it was healthy:\n{self.logs(name)}")
            timeout = compose.seconds(check["timeout"])
            result = subprocess.run(args, env=_base_environ(), capture_output=True, text=True, timeout=timeout + 10)
            if result.returncode == 0:
                return
            if time.monotonic() > deadline:
                pytest.fail(f"{name} not healthy in time ({result.stderr or result.stdout}):\n{self.logs(name)}")
            time.sleep(min(interval, 2.0))

    def stop(self) -> list[str]:
        """SIGTERM in reverse start order, as compose stops; the names of those killed after their grace period."""
        killed = []
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.terminate()
            grace = compose.seconds(self.services[name].get("stop_grace_period", "10s"))
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                killed.append(name)
        return killed


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    local = LocalStack(tmp_path_factory.mktemp("compose-logs"))
    try:
        order = compose.startup_order(local.services, compose.KVGRID_SERVICES)
        for name in order:
            for dep, spec in (local.services[name].get("depends_on") or {}).items():
                assert spec["condition"] == "service_started", f"{name} waits for {dep} with {spec}"
            local.start(name)
        for name in order:
            local.wait_healthy(name)
        yield local
    finally:
        local.stop()


def test_generate_through_the_compose_services(stack):
    addr = f"127.0.0.1:{stack.port_map[('tokenizer', 50051)]}"
    request = generate_pb2.GenerateRequest(
        prompt="The capital of France is", sampling=common_pb2.SamplingParams(max_tokens=8), request_id="compose-1"
    )
    with grpc.insecure_channel(addr) as channel:
        replies = list(generate_pb2_grpc.TextGenerationStub(channel).Generate(request, timeout=300))
    token_ids = [t for r in replies for t in r.token_ids]
    last = replies[-1]
    assert last.finish_reason in ("length", "stop"), last
    assert 0 < len(token_ids) <= 8
    assert last.usage.completion_tokens == len(token_ids)
    assert last.usage.prompt_tokens > 0
    assert "".join(r.text for r in replies).strip(), f"no text in {replies}"


def test_prometheus_targets_serve_kvgrid_metrics(stack):
    config = yaml.safe_load((compose.ROOT / "docker/prometheus/prometheus.yml").read_text())
    targets = [t for job in config["scrape_configs"] for sc in job.get("static_configs", ()) for t in sc["targets"]]
    assert {t.split(":")[0] for t in targets} == set(compose.KVGRID_SERVICES)
    for target in targets:
        host, port = target.split(":")
        url = f"http://127.0.0.1:{stack.port_map[(host, int(port))]}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            body = reply.read().decode()
        assert "kvgrid_" in body, f"{target} serves no kvgrid metrics"


def test_services_stop_within_their_grace_period(stack):
    """Runs last: SIGTERM (what compose sends through tini) ends each service before compose would SIGKILL it."""
    killed = stack.stop()
    assert not killed, f"{killed} ignored SIGTERM for their whole stop_grace_period"
    for name, proc in stack.procs.items():
        assert proc.returncode in (0, -15), f"{name} exited with {proc.returncode}:\n{stack.logs(name)}"
