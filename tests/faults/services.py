"""The three services as separate processes on free ports, each one stoppable, killable and restartable."""

from __future__ import annotations

import pathlib
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.e2e.stack import child_env
from tests.procs import free_ports, terminate

# float32 on a small cache: quick to start, exact greedy comparisons.
# One math thread: on a machine whose cores are oversubscribed, OpenMP teams spin against each other.
MODEL_ARGS = ["--dtype", "float32", "--kv-cache-memory", "256MiB", "--max-model-len", "1024", "--num-threads", "1"]


def serving(addr: str) -> bool:
    with grpc.insecure_channel(addr) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def wait_serving(addr: str, what: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not serving(addr):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} at {addr} not SERVING within {timeout:.0f}s")
        time.sleep(0.2)


@dataclass
class Services:
    """Worker, scheduler and tokenizer processes; ``args[name]`` are extra flags for that service."""

    log_dir: pathlib.Path
    args: dict[str, list[str]] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def __post_init__(self) -> None:
        names = ("tokenizer", "http", "scheduler", "scheduler_metrics", "worker", "worker_metrics")
        self.ports = dict(zip(names, free_ports(len(names)), strict=True))

    def addr(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def argv(self, name: str) -> list[str]:
        p = self.ports
        flags = {
            "worker": ["--worker-port", p["worker"], "--worker-metrics-port", p["worker_metrics"]],
            "scheduler": ["--scheduler-port", p["scheduler"], "--scheduler-metrics-port", p["scheduler_metrics"]]
            + ["--worker-addr", self.addr("worker")],
            "tokenizer": ["--tokenizer-port", p["tokenizer"], "--http-port", p["http"]]
            + ["--scheduler-addr", self.addr("scheduler")],
        }[name]
        extra = MODEL_ARGS if name == "worker" else []
        return [sys.executable, "-m", "kvgrid.cli", name, "--host", "127.0.0.1", *map(str, flags), *extra]

    def start(self, name: str, *args: str) -> subprocess.Popen:
        log = (self.log_dir / f"{name}.log").open("a")
        argv = self.argv(name) + [*self.args.get(name, []), *args]
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=child_env())
        log.close()
        return self.procs[name]

    def start_all(self) -> Services:
        for name in ("worker", "scheduler", "tokenizer"):
            self.start(name)
        self.wait_serving("tokenizer")
        return self

    def wait_serving(self, name: str, timeout: float = 240) -> None:
        wait_serving(self.addr(name), name, timeout)

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def stop_all(self) -> None:
        for name in ("tokenizer", "scheduler", "worker"):
            if name in self.procs:
                terminate(self.procs[name], 30)

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")
