"""The real stack as separate processes (`python -m kvgrid.cli worker|scheduler|tokenizer`), one log file each.

Two frontends share the scheduler, as stateless replicas do: one logs text, one
logs JSON (the scheduler and the worker log JSON too). Start-up goes scheduler and frontends
first, worker last, recording what each health endpoint says on the way, so the
tests can check the transitions without racing the model load.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
from dataclasses import dataclass, field

from tests.observability.probes import grpc_health, http_get, wait_for
from tests.procs import free_ports, terminate

ROOT = pathlib.Path(__file__).resolve().parents[2]
# 24 float32 blocks of 16 tokens (737,280 bytes each for SmolLM2): 384 tokens, so 4 requests of 120 tokens preempt.
KV_CACHE_MEMORY = str(24 * 737_280)
MAX_MODEL_LEN = "256"
START_TIMEOUT_S = 120.0
WORKER_READY_TIMEOUT_S = 420.0  # a model load on a shared 2-core machine can take minutes


@dataclass
class Proc:
    name: str
    argv: list[str]
    log_path: pathlib.Path
    env: dict[str, str]
    process: subprocess.Popen | None = None

    def start(self) -> Proc:
        with self.log_path.open("a") as log:
            self.process = subprocess.Popen(self.argv, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            raise AssertionError(f"{self.name} exited with {self.process.returncode}:\n{self.log()[-4000:]}")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def terminate(self, timeout: float = 30.0) -> int:
        return terminate(self.process, timeout)


@dataclass
class Frontend:
    proc: Proc
    port: int
    http_port: int

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def http_health(self) -> int | None:
        reply = http_get(self.http_port, "/health")
        return None if reply is None else reply[0]


@dataclass
class ObservedStack:
    tmp: pathlib.Path
    env: dict[str, str]
    ports: dict[str, int] = field(default_factory=dict)
    procs: list[Proc] = field(default_factory=list)
    # what each health endpoint said before the worker was started / while it loaded
    startup: dict[str, object] = field(default_factory=dict)

    def __post_init__(self):
        names = ("worker", "worker_metrics", "scheduler", "scheduler_metrics", "text", "text_http", "json", "json_http")
        self.ports = dict(zip(names, free_ports(len(names)), strict=True))
        p = self.ports
        worker_flags = ["--dtype", "float32", "--kv-cache-memory", KV_CACHE_MEMORY, "--max-model-len", MAX_MODEL_LEN]
        worker_flags += ["--log-format", "json"]
        worker_flags += ["--worker-port", p["worker"], "--worker-metrics-port", p["worker_metrics"]]
        self.worker = self._proc("worker", "worker", worker_flags)
        scheduler_flags = ["--max-model-len", MAX_MODEL_LEN, "--log-format", "json", "--worker-addr", self.worker_addr]
        scheduler_flags += ["--scheduler-port", p["scheduler"], "--scheduler-metrics-port", p["scheduler_metrics"]]
        self.scheduler = self._proc("scheduler", "scheduler", scheduler_flags)
        self.text = self._frontend("text", [])
        self.json = self._frontend("json", ["--log-format", "json"])

    @property
    def worker_addr(self) -> str:
        return f"127.0.0.1:{self.ports['worker']}"

    @property
    def scheduler_addr(self) -> str:
        return f"127.0.0.1:{self.ports['scheduler']}"

    def _proc(self, name: str, command: str, flags: list) -> Proc:
        argv = [sys.executable, "-m", "kvgrid.cli", command, "--host", "127.0.0.1", *map(str, flags)]
        proc = Proc(name, argv, self.tmp / f"{name}.log", self.env)
        self.procs.append(proc)
        return proc

    def _frontend(self, name: str, flags: list[str]) -> Frontend:
        port, http_port = self.ports[name], self.ports[f"{name}_http"]
        flags = [*flags, "--tokenizer-port", port, "--http-port", http_port, "--scheduler-addr", self.scheduler_addr]
        proc = self._proc(f"tokenizer-{name}", "tokenizer", flags)
        return Frontend(proc, port, http_port)

    def start(self) -> ObservedStack:
        for proc in (self.scheduler, self.text.proc, self.json.proc):
            proc.start()
        self.startup["scheduler"] = self._first_answer(self.scheduler, lambda: grpc_health(self.scheduler_addr))
        for frontend in (self.text, self.json):
            name = frontend.proc.name
            self.startup[f"{name} /health"] = self._first_answer(frontend.proc, frontend.http_health)
            self.startup[name] = grpc_health(frontend.addr)
        self.worker.start()
        self.startup["worker"] = self._first_answer(self.worker, lambda: grpc_health(self.worker_addr))
        self.wait_serving()
        return self

    def wait_serving(self) -> None:
        """Until the worker, the scheduler and both frontends serve."""

        def serving() -> bool:
            for proc in self.procs:
                proc.check_alive()
            return (
                grpc_health(self.worker_addr) == "SERVING"
                and grpc_health(self.scheduler_addr) == "SERVING"
                and self.text.http_health() == 200
                and self.json.http_health() == 200
            )

        wait_for(serving, WORKER_READY_TIMEOUT_S, "the stack to serve", interval=0.5)

    @staticmethod
    def _first_answer(proc: Proc, probe):
        def answer():
            proc.check_alive()
            return probe()

        return wait_for(answer, START_TIMEOUT_S, f"{proc.name} to answer", interval=0.05)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.process is not None:
                proc.terminate(timeout=20)
