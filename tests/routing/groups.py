"""Several worker groups (a scheduler + worker process pair each) behind frontends, as separate processes."""

from __future__ import annotations

import pathlib
import signal
import subprocess
import sys
from dataclasses import dataclass, field

import grpc

from kvgrid.v1 import common_pb2, generate_pb2, generate_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tests.e2e.stack import child_env
from tests.faults.services import serving, wait_serving
from tests.procs import free_ports, terminate

WORKER_ARGS = ["--device", "cpu", "--dtype", "float32", "--num-threads", "1"]


def _start(argv: list[str], log_path: pathlib.Path) -> subprocess.Popen:
    log = log_path.open("a")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvgrid.cli", *argv, "--host", "127.0.0.1"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=child_env(),
    )
    log.close()
    return proc


@dataclass
class Group:
    """One scheduler and its worker on free ports; killable and restartable on the same ports."""

    name: str
    model: str
    log_dir: pathlib.Path
    worker_args: list[str] = field(default_factory=list)
    scheduler_args: list[str] = field(default_factory=list)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.ports = dict(zip(("worker", "worker_m", "scheduler", "scheduler_m"), free_ports(4), strict=True))

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.ports['scheduler']}"

    def start(self) -> Group:
        p = self.ports
        worker = ["worker", "--model", self.model, *WORKER_ARGS, *self.worker_args]
        worker += ["--worker-port", str(p["worker"]), "--worker-metrics-port", str(p["worker_m"])]
        self.procs["worker"] = _start(worker, self.log_dir / f"{self.name}-worker.log")
        scheduler = ["scheduler", "--worker-addr", f"127.0.0.1:{p['worker']}", *self.scheduler_args]
        scheduler += ["--scheduler-port", str(p["scheduler"]), "--scheduler-metrics-port", str(p["scheduler_m"])]
        self.procs["scheduler"] = _start(scheduler, self.log_dir / f"{self.name}-scheduler.log")
        return self

    def wait_serving(self, timeout: float = 240) -> None:
        wait_serving(self.addr, f"group {self.name}", timeout)

    @property
    def serving(self) -> bool:
        return serving(self.addr)

    def kill(self) -> None:
        for proc in self.procs.values():
            proc.send_signal(signal.SIGKILL)
            proc.wait()

    def stop(self) -> None:
        for name in ("scheduler", "worker"):
            if name in self.procs:
                terminate(self.procs[name], 20)

    def stats(self) -> scheduler_pb2.SchedulerStats:
        with grpc.insecure_channel(self.addr) as channel:
            return scheduler_pb2_grpc.SchedulerStub(channel).GetStats(scheduler_pb2.GetStatsRequest(), timeout=10)


@dataclass
class Frontend:
    """A ``kvgrid tokenizer`` routing over ``addrs``."""

    addrs: list[str]
    log_path: pathlib.Path
    extra: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None

    def __post_init__(self) -> None:
        self.port, self.http_port = free_ports(2)

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> Frontend:
        argv = ["tokenizer", "--scheduler-addrs", ",".join(self.addrs), *self.extra]
        argv += ["--tokenizer-port", str(self.port), "--http-port", str(self.http_port)]
        self.proc = _start(argv, self.log_path)
        return self

    def wait_serving(self, timeout: float = 240) -> None:
        wait_serving(self.addr, "frontend", timeout)

    def stop(self) -> None:
        if self.proc is not None:
            terminate(self.proc, 20)


def generate(addr: str, prompt: list[int], max_tokens: int = 4, timeout: float = 60) -> list[int]:
    """Greedy token ids for ``prompt`` through the frontend at ``addr`` (raises grpc.RpcError)."""
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    request = generate_pb2.GenerateRequest(prompt_token_ids=prompt, sampling=sampling)
    with grpc.insecure_channel(addr) as channel:
        stub = generate_pb2_grpc.TextGenerationStub(channel)
        return [t for response in stub.Generate(request, timeout=timeout) for t in response.token_ids]
