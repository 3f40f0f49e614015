"""`kvgrid serve` without a model: flags handed to each service, port checks, supervision of fake children."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from kvgrid.cli import serve, supervision
from kvgrid.cli.probes import is_serving
from kvgrid.cli.supervision import Child, RestartPolicy
from services.common import config as cfg
from services.common import cpu_quota
from tests.procs import free_ports

# A stand-in service: gRPC health SERVING on the given port until terminated.
FAKE_SERVICE = """
import sys, time
from concurrent import futures
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
servicer = health.HealthServicer()
servicer.set("", health_pb2.HealthCheckResponse.SERVING)
health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
server.add_insecure_port("127.0.0.1:" + sys.argv[1])
server.start()
while True:
    time.sleep(1)
"""


def parse(argv: list[str]) -> cfg.Config:
    parser = argparse.ArgumentParser()
    cfg.add_arguments(parser)
    return cfg.build_config(cfg.ALL_SECTIONS, parser.parse_args(argv), environ={})


def flag_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_each_service_gets_its_own_flags_and_addresses_follow_the_ports():
    config = serve.child_config(parse(["--scheduler-port", "6001", "--worker-port", "6002", "--dtype", "float32"]))
    children = {c.name: c for c in serve.build_children(config)}
    assert list(children) == ["worker", "scheduler", "tokenizer"]
    worker, scheduler, tokenizer = children["worker"].argv, children["scheduler"].argv, children["tokenizer"].argv
    assert worker[1:4] == ["-m", "kvgrid.cli", "worker"]
    assert flag_value(tokenizer, "--scheduler-addr") == "127.0.0.1:6001"
    assert flag_value(scheduler, "--worker-addr") == "127.0.0.1:6002"
    assert flag_value(worker, "--worker-port") == "6002"
    assert all(flag_value(argv, "--dtype") == "float32" for argv in (worker, scheduler, tokenizer))
    assert "--device" in worker and "--device" not in scheduler and "--device" not in tokenizer
    assert "--block-size" in scheduler and "--block-size" not in tokenizer
    assert children["tokenizer"].grpc_addr == "127.0.0.1:50051"


def test_every_service_accepts_what_serve_hands_it():
    from kvgrid.cli import build_parser

    for child in serve.build_children(serve.child_config(parse([]))):
        build_parser().parse_args(child.argv[3:])


def test_dial_host_maps_wildcards_to_loopback():
    assert serve.dial_host("0.0.0.0") == "127.0.0.1"
    assert serve.dial_host("::") == "[::1]"
    assert serve.dial_host("10.1.2.3") == "10.1.2.3"


def test_busy_zero_and_duplicate_ports_are_reported_before_anything_starts():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        a, b, c = free_ports(3)
        proc = subprocess.run(
            [sys.executable, "-m", "kvgrid.cli", "serve", "--host", "127.0.0.1", "--tokenizer-port", str(taken)]
            + ["--http-port", "0", "--scheduler-port", str(a), "--worker-port", str(a)]
            + ["--scheduler-metrics-port", str(b), "--worker-metrics-port", str(c)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert lines == [
        f"kvgrid serve: port {taken} (--tokenizer-port) is already in use on 127.0.0.1; "
        f"free it or pass --tokenizer-port PORT",
        "kvgrid serve: --http-port 0 is not allowed here: `kvgrid serve` needs fixed ports",
        f"kvgrid serve: --worker-port {a} is also given to --scheduler-port",
    ]
    assert "starting" not in proc.stdout


def fake_children(ports: list[int], crash: str = "") -> list[Child]:
    children = []
    for name, port in zip(serve.SERVICE_ORDER, ports, strict=True):
        code = "import sys; sys.exit(3)" if name == crash else FAKE_SERVICE
        children.append(Child(name, [sys.executable, "-c", code, str(port)], f"127.0.0.1:{port}"))
    return children


@pytest.fixture
def signals(monkeypatch):
    monkeypatch.setattr(serve, "POLL_SECONDS", 0.1)
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    handler = supervision.Signals()
    yield handler
    for sig, old in previous.items():
        signal.signal(sig, old)


def supervise_then(after_ready, signals, monkeypatch) -> tuple[int, list]:
    """Supervise three fake children; once the ready line is out, ``after_ready(children)`` runs."""
    announce = serve.print_ready

    def announce_then_act(config, children):
        announce(config, children)
        after_ready(children)

    monkeypatch.setattr(serve, "print_ready", announce_then_act)
    children = fake_children(free_ports(3))
    for child in children:
        supervision.start(child)
    try:
        return serve.supervise(parse(["--host", "127.0.0.1"]), children, signals), children
    finally:
        supervision.stop_all(children)


@pytest.mark.timeout(120)
def test_ready_then_sigterm_stops_every_child(signals, capsys, monkeypatch):
    code, children = supervise_then(lambda _: os.kill(os.getpid(), signal.SIGTERM), signals, monkeypatch)
    assert code == 0
    out = capsys.readouterr().out
    assert "kvgrid serve: ready" in out and "kvgrid generate" in out and "SIGTERM received" in out
    assert all(c.process.poll() is not None for c in children)


@pytest.mark.timeout(120)
def test_a_child_that_dies_at_startup_stops_the_others(signals, capsys):
    children = fake_children(free_ports(3), crash="scheduler")
    for child in children:
        supervision.start(child)
    try:
        assert serve.supervise(parse([]), children, signals) == 1
    finally:
        supervision.stop_all(children)
    assert "start-up failed: the scheduler exited with code 3" in capsys.readouterr().out
    assert all(c.process.poll() is not None for c in children)


@pytest.mark.timeout(120)
def test_a_child_that_dies_after_ready_is_restarted(signals, capsys, monkeypatch):
    restarted = []

    def kill_worker_then_stop_once_restarted(children):
        def act():  # in a thread: the supervision loop must go on meanwhile
            worker = children[0]
            old = worker.process
            old.kill()
            deadline = time.monotonic() + 60
            while worker.process is old or not is_serving(worker.grpc_addr):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            else:
                restarted.append(worker.process.pid)
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=act, daemon=True).start()

    code, children = supervise_then(kill_worker_then_stop_once_restarted, signals, monkeypatch)
    assert code == 0 and restarted, "the worker was not restarted and SERVING again"
    out = capsys.readouterr().out
    assert "the worker was killed by signal SIGKILL; restarting it in 1s" in out
    assert f"restarted the worker (pid {children[0].process.pid})" in out
    assert all(c.process.poll() is not None for c in children)


@pytest.mark.timeout(120)
def test_a_child_that_keeps_crashing_stops_the_stack(signals, capsys, monkeypatch):
    def crash_scheduler_for_good(children):
        scheduler = children[1]
        scheduler.restarts = RestartPolicy(first_backoff=0.1, max_crashes=2)
        scheduler.argv = [sys.executable, "-c", "import sys; sys.exit(3)"]
        scheduler.process.kill()

    code, children = supervise_then(crash_scheduler_for_good, signals, monkeypatch)
    assert code == 1
    out = capsys.readouterr().out
    assert "restarting it in 0.1s" in out and "restarting it in 0.2s" in out
    assert "the scheduler exited with code 3: 3 exits within 120s, so it is not restarted again" in out
    assert all(c.process.poll() is not None for c in children)


def test_restart_backoff_doubles_and_too_many_crashes_in_the_window_give_up():
    policy = RestartPolicy(first_backoff=1, max_backoff=4, max_crashes=3, window=60)
    assert [policy.crashed(t) for t in (0, 1, 2)] == [1, 2, 4]
    assert policy.crashed(3) is None  # the 4th within 60 s
    policy = RestartPolicy(first_backoff=1, max_backoff=4, max_crashes=3, window=60)
    assert [policy.crashed(t) for t in (0, 100, 200, 300)] == [1, 1, 1, 1]  # spread out: never more than one


def test_worker_thread_arrangement():
    from kvgrid.cli.serve import worker_arrangement

    env, line = worker_arrangement(0, 2, {})
    assert env == {"GOMP_SPINCOUNT": "300000"} and "2 threads sharing 2 cores" in line
    env, line = worker_arrangement(0, 2, {"OMP_WAIT_POLICY": "active"})
    assert env == {} and "OMP_WAIT_POLICY=active" in line
    env, line = worker_arrangement(4, 16, {})
    assert env == {} and "4 threads on 16 cores" in line


def test_serve_hands_the_worker_its_arrangement(monkeypatch, capsys):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setattr(serve.os, "sched_getaffinity", lambda _pid: {0, 1})
    monkeypatch.setattr(cpu_quota, "cpu_quota_cores", lambda: None)
    config = serve.child_config(parse([]))
    worker = serve.build_children(config)[0]
    serve.arrange_worker_threads(config, worker)
    assert worker.env == {"GOMP_SPINCOUNT": "300000"}
    assert "kvgrid serve: worker: 2 threads sharing 2 cores" in capsys.readouterr().out


def test_serve_counts_no_more_cores_than_the_cgroup_s_cpu_quota(monkeypatch, capsys):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setattr(serve.os, "sched_getaffinity", lambda _pid: set(range(64)))
    monkeypatch.setattr(cpu_quota, "cpu_quota_cores", lambda: 4.5)  # a pod's limits.cpu: 4500m on a 64-core node
    config = serve.child_config(parse([]))
    worker = serve.build_children(config)[0]
    serve.arrange_worker_threads(config, worker)
    assert worker.env == {"GOMP_SPINCOUNT": "300000"}
    assert "kvgrid serve: worker: 4 threads sharing 4 cores" in capsys.readouterr().out


def fake_install(root) -> tuple[str, str]:
    """A virtualenv-like bin/ with an interpreter and the console script; returns (python, bin dir)."""
    bin_dir = root / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("python", "kvgrid"):
        (bin_dir / name).write_text("#!/bin/sh\n")
        (bin_dir / name).chmod(0o755)
    return str(bin_dir / "python"), str(bin_dir)


def test_ready_line_names_the_venv_script_when_the_venv_is_not_on_path(tmp_path):
    python, bin_dir = fake_install(tmp_path)
    # `make serve` from the checkout in a fresh shell: .venv/bin is not on PATH
    assert serve.kvgrid_command(python, path="/usr/bin:/bin", cwd=str(tmp_path)) == ".venv/bin/kvgrid"
    # from elsewhere the path is absolute
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert serve.kvgrid_command(python, path="/usr/bin", cwd=str(elsewhere)) == f"{bin_dir}/kvgrid"
    # another kvgrid first on PATH would run something else
    other, _ = fake_install(tmp_path / "other")
    path = f"{os.path.dirname(other)}:{bin_dir}"
    assert serve.kvgrid_command(python, path=path, cwd=str(tmp_path)) == ".venv/bin/kvgrid"


def test_ready_line_says_plain_kvgrid_when_path_finds_this_one(tmp_path):
    python, bin_dir = fake_install(tmp_path)
    # an activated virtualenv (its bin/ first on PATH), or a system install
    assert serve.kvgrid_command(python, path=f"{bin_dir}:/usr/bin", cwd=str(tmp_path)) == "kvgrid"


def test_ready_line_without_a_console_script_runs_the_module(tmp_path):
    python, bin_dir = fake_install(tmp_path)
    os.remove(os.path.join(bin_dir, "kvgrid"))
    assert serve.kvgrid_command(python, path="/nowhere", cwd=str(tmp_path)) == ".venv/bin/python -m kvgrid.cli"


def test_ready_message_prints_the_command_that_works_as_pasted(tmp_path, monkeypatch, capsys):
    python, _ = fake_install(tmp_path)
    monkeypatch.setattr(serve.sys, "executable", python)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.chdir(tmp_path)
    serve.print_ready(parse(["--host", "127.0.0.1"]), [])
    assert '    .venv/bin/kvgrid generate "What is the capital of France?" --addr 127.0.0.1:50051' in (
        capsys.readouterr().out.splitlines()
    )


def test_api_server_count_makes_frontends_that_stop_together_and_share_metrics(tmp_path):
    config = serve.child_config(parse(["--api-server-count", "3"]))
    children = serve.build_children(config)
    assert [c.name for c in children] == ["worker", "scheduler", "tokenizer-1", "tokenizer-2", "tokenizer-3"]
    assert [[c.name for c in stage] for stage in supervision.stages(children)][-1] == [
        "tokenizer-1",
        "tokenizer-2",
        "tokenizer-3",
    ]
    assert "--api-server-count" in children[2].argv and children[2].argv == children[4].argv
    made = serve.share_frontend_metrics(children, environ={})
    try:
        assert made and os.path.isdir(made)
        assert {c.env.get("PROMETHEUS_MULTIPROC_DIR") for c in children} == {None, made}
    finally:
        os.rmdir(made)
    own = serve.build_children(config)
    assert serve.share_frontend_metrics(own, environ={"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}) == ""
    assert own[3].env["PROMETHEUS_MULTIPROC_DIR"] == str(tmp_path)
    single = serve.build_children(serve.child_config(parse([])))
    assert [c.name for c in single][-1] == "tokenizer" and serve.share_frontend_metrics(single, environ={}) == ""
