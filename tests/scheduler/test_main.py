"""`kvgrid scheduler` as a process: serves, waits for a worker, exits 0 on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvgrid.v1 import scheduler_pb2, scheduler_pb2_grpc
from tests.procs import free_port as _free_port


@pytest.mark.timeout(120)
def test_the_cli_serves_until_sigterm_and_retries_an_absent_worker():
    port, metrics_port, worker_port = _free_port(), _free_port(), _free_port()
    env = {**os.environ, "KVGRID_WORKER_ADDR": f"127.0.0.1:{worker_port}"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvgrid.cli", "scheduler", "--host", "127.0.0.1", "--scheduler-port", str(port)]
        + ["--scheduler-metrics-port", str(metrics_port)],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=60)
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING  # no worker yet
            stats = scheduler_pb2_grpc.SchedulerStub(channel).GetStats(scheduler_pb2.GetStatsRequest())
            assert not stats.worker_ready
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        assert "kvgrid_num_requests_waiting" in metrics and "kvgrid_kv_cache_usage_ratio" in metrics
        time.sleep(0.5)  # a few dial attempts
        assert proc.poll() is None  # an absent worker is no reason to exit
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert "retrying" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
