"""A real kvgrid stack for end-to-end tests: `kvgrid serve` in a subprocess on free ports."""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from kvgrid.v1 import generate_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.procs import free_ports, terminate

PORT_FLAGS = (
    "--tokenizer-port",
    "--http-port",
    "--scheduler-port",
    "--scheduler-metrics-port",
    "--worker-port",
    "--worker-metrics-port",
)
READY_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 40.0


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGRID_")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    return env


@dataclass
class Stack:
    """One `kvgrid serve` process and its log; `stop()` ends it and every child, even after a failure."""

    log_path: pathlib.Path
    extra_args: list[str]
    ports: dict[str, int] = field(default_factory=dict)
    process: subprocess.Popen | None = None
    child_pids: dict[str, int] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)  # added to serve's environment

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.ports['--tokenizer-port']}"

    @property
    def scheduler_addr(self) -> str:
        return f"127.0.0.1:{self.ports['--scheduler-port']}"

    def start(self) -> Stack:
        self.ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS)), strict=True))
        argv = [sys.executable, "-m", "kvgrid.cli", "serve", "--host", "127.0.0.1", *self.extra_args]
        for flag, port in self.ports.items():
            argv += [flag, str(port)]
        log = self.log_path.open("w")
        self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**child_env(), **self.env})
        log.close()
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> Stack:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log()
            match = re.search(r"kvgrid serve: ready \(([^)]*)\)", text)
            if match:
                self.child_pids = {m[0]: int(m[1]) for m in re.findall(r"([\w-]+) pid (\d+)", match.group(1))}
                return self
            if self.process.poll() is not None:
                raise RuntimeError(f"kvgrid serve exited with {self.process.returncode}:\n{text[-6000:]}")
            time.sleep(0.5)
        raise TimeoutError(f"kvgrid serve not ready in {timeout:.0f}s:\n{self.log()[-6000:]}")

    def terminate(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM serve and wait; returns its exit code (SIGKILL after the timeout)."""
        if self.process is None:
            return 0
        return terminate(self.process, timeout)

    def stop(self) -> None:
        self.terminate()
        for pid in self.child_pids.values():  # serve's children die with it (PDEATHSIG); make sure
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@contextlib.contextmanager
def running_stack(log_path: pathlib.Path, extra_args: list[str]) -> Iterator[Stack]:
    """A ready stack for the body of the ``with``, stopped after it whatever happened."""
    stack = Stack(log_path, extra_args).start()
    try:
        yield stack.wait_ready()
    finally:
        stack.stop()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead too: its parent just has not reaped it
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def collect(stream) -> tuple[str, list[int], generate_pb2.GenerateResponse]:
    """(text, token ids, last message) of a Generate/Chat stream."""
    text, ids, last = [], [], None
    for response in stream:
        text.append(response.text)
        ids.extend(response.token_ids)
        last = response
    return "".join(text), ids, last


def get_stats(channel: grpc.Channel) -> scheduler_pb2.SchedulerStats:
    return scheduler_pb2_grpc.SchedulerStub(channel).GetStats(scheduler_pb2.GetStatsRequest(), timeout=10)


def wait_idle(channel: grpc.Channel, timeout: float = 60.0) -> scheduler_pb2.SchedulerStats:
    """GetStats once nothing is running, waiting or holding blocks (or the last stats at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = get_stats(channel)
        idle = stats.num_running == 0 and stats.num_waiting == 0 and stats.num_blocks_used == 0
        if idle or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)
