"""`kvgrid worker` as a process: serves after loading, answers a step, exits 0 on SIGTERM; refuses a cache too small."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvgrid.v1 import worker_pb2, worker_pb2_grpc
from tests.worker.tiny import save_tiny_model, save_tiny_tokenizer

pytestmark = pytest.mark.timeout(300)
SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny-with-tokenizer"))
    save_tiny_model(path, "llama")
    save_tiny_tokenizer(path)
    return path


def _worker(model: str, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvgrid.cli", "worker", "--model", model, "--device", "cpu"]
    cmd += ["--host", "127.0.0.1", "--worker-port", "0", "--worker-metrics-port", "0", *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "KVGRID_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)


def _wait_ready(proc: subprocess.Popen) -> tuple[int, list[str]]:
    lines, port = [], None
    for line in proc.stderr:
        lines.append(line)
        if m := re.search(r"worker gRPC on 127\.0\.0\.1:(\d+)", line):
            port = int(m.group(1))
        if "worker ready" in line:
            # Keep draining stderr so the worker never blocks on a full pipe.
            threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
            return port, lines
    raise AssertionError("worker exited before it was ready:\n" + "".join(lines))


def test_serves_then_exits_on_sigterm(tiny_dir):
    proc = _worker(tiny_dir, "--kv-cache-memory", "1MiB", "--block-size", "16")
    try:
        port, _ = _wait_ready(proc)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            stub = worker_pb2_grpc.WorkerStub(channel)
            hs = stub.Handshake(worker_pb2.HandshakeRequest(scheduler_id="t"), timeout=10)
            assert (hs.model, hs.vocab_size, hs.max_model_len, hs.block_size) == ("tiny-with-tokenizer0", 160, 256, 16)
            assert hs.num_blocks == 2**20 // hs.bytes_per_block and 150 in hs.eos_token_ids
            assert "tokenizer.json" in hs.tokenizer_files
            plan = worker_pb2.StepPlan(
                step_id=7,
                new_requests=[
                    worker_pb2.NewRequest(
                        request_id="a", token_ids=[3, 1, 4], num_prompt_tokens=3, block_ids=[5], num_scheduled_tokens=3
                    )
                ],
            )
            (result,) = list(stub.Execute(iter([plan]), timeout=30))
            assert result.step_id == 7 and [s.request_id for s in result.sampled] == ["a"]
            assert 0 <= result.sampled[0].token_id < 160
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_refuses_a_cache_smaller_than_one_sequence(tiny_dir):
    proc = _worker(tiny_dir, "--kv-cache-memory", "32KiB")
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 1 and "Traceback" not in err
    (line,) = [x for x in err.splitlines() if x.startswith("kvgrid worker: ")]
    assert "--max-model-len 256 tokens needs 16 blocks" in line and "raise --kv-cache-memory" in line


def test_sigterm_drains_the_requests_it_holds_before_exiting(tiny_dir):
    proc = _worker(tiny_dir, "--kv-cache-memory", "1MiB", "--shutdown-grace", "120")
    plans: queue.Queue = queue.Queue()
    try:
        port, lines = _wait_ready(proc)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            stub.Handshake(worker_pb2.HandshakeRequest(scheduler_id="t"), timeout=10)  # plans follow a handshake
            results = stub.Execute(iter(plans.get, None), timeout=120)
            new = worker_pb2.NewRequest(
                request_id="a", token_ids=[3, 1, 4], num_prompt_tokens=3, block_ids=[5], num_scheduled_tokens=3
            )
            plans.put(worker_pb2.StepPlan(step_id=1, new_requests=[new]))
            assert next(results).step_id == 1
            proc.send_signal(signal.SIGTERM)
            health = health_pb2_grpc.HealthStub(channel)
            while health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == SERVING:
                time.sleep(0.05)
            with pytest.raises(grpc.RpcError) as e:  # a draining worker takes no new scheduler
                stub.Handshake(worker_pb2.HandshakeRequest(scheduler_id="late"), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            # It still runs the steps of the request it holds, until the scheduler drops it.
            running = worker_pb2.RunningRequest(request_id="a", num_scheduled_tokens=1)
            plans.put(worker_pb2.StepPlan(step_id=2, running=[running]))
            assert next(results).step_id == 2 and proc.poll() is None
            plans.put(worker_pb2.StepPlan(step_id=3, finished_ids=["a"]))
            assert next(results).step_id == 3
            plans.put(None)
        assert proc.wait(timeout=60) == 0
    finally:
        plans.put(None)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
