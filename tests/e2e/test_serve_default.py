"""`kvgrid serve` as `make serve` runs it (ports and sizes overridden) in bfloat16, and the shell clients.

`--dtype auto` is bfloat16 only on CPUs with native bf16 (float32 elsewhere), so the dtype is explicit.
"""

from __future__ import annotations

import subprocess
import sys
import time

import grpc
import pytest

from kvgrid.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.e2e.stack import Stack, child_env, collect, pid_alive

pytestmark = pytest.mark.timeout(600)

TOP_K = 5
PROMPTS = [
    "The capital of France is",
    "Les trois plus grandes villes de France sont",
    "東京は日本の首都で、",
    "def add(a, b):\n    ",
]


@pytest.fixture(scope="module")
def default_stack(tmp_path_factory, hf):
    args = ["--dtype", "bfloat16", "--kv-cache-memory", "256MiB"]
    stack = Stack(tmp_path_factory.mktemp("bf16") / "serve.log", args).start()
    try:
        yield stack.wait_ready()
    finally:
        stack.stop()


def kvgrid(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvgrid.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
        env=child_env(),
    )


def test_serve_prints_the_endpoints_and_a_client_command(default_stack):
    log = default_stack.log()
    assert f"grpc://{default_stack.addr}" in log
    assert f'kvgrid generate "What is the capital of France?" --addr {default_stack.addr}' in log
    assert set(default_stack.child_pids) == {"worker", "scheduler", "tokenizer"}


def test_kvgrid_generate_answers_paris(default_stack):
    proc = kvgrid("generate", "What is the capital of France?", "--addr", default_stack.addr)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert proc.stderr == ""


def test_kvgrid_chat_answers_from_piped_input(default_stack):
    proc = kvgrid(
        "chat", "--addr", default_stack.addr, "--max-tokens", "32", stdin="What is the capital of France?\n/exit\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_bfloat16_tokens_are_within_the_reference_top5(default_stack, hf):
    with grpc.insecure_channel(default_stack.addr) as channel:
        stub = generate_pb2_grpc.TextGenerationStub(channel)
        info = stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=30)
        assert info.dtype == "bfloat16"
        sampling = common_pb2.SamplingParams(max_tokens=32)
        outputs = [collect(stub.Generate(generate_pb2.GenerateRequest(prompt=p, sampling=sampling))) for p in PROMPTS]
    for prompt, (_, ids, _) in zip(PROMPTS, outputs, strict=True):
        assert ids, prompt
        prompt_ids = hf.encode(prompt)
        # Teacher forcing on kvgrid's own tokens: every position has the same context on both sides,
        # so the rule applies at every position, not only up to the first divergence.
        top = hf.top_k_under_teacher_forcing(prompt_ids, ids, TOP_K)
        outside = [(i, token) for i, (token, allowed) in enumerate(zip(ids, top, strict=True)) if token not in allowed]
        assert not outside, f"{prompt!r}: tokens outside the float32 top-{TOP_K} at {outside}"


def test_sigterm_stops_serve_and_all_three_services(default_stack):
    pids = dict(default_stack.child_pids)
    assert all(pid_alive(pid) for pid in pids.values())
    assert default_stack.terminate() == 0
    deadline = time.monotonic() + 10
    while any(pid_alive(pid) for pid in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [name for name, pid in pids.items() if pid_alive(pid)]
    assert "kvgrid serve: stopped" in default_stack.log()


def test_a_worker_that_cannot_start_stops_serve_with_a_clear_message(tmp_path):
    stack = Stack(tmp_path / "serve.log", ["--model", str(tmp_path / "missing.gguf")]).start()
    try:
        code = stack.process.wait(timeout=240)
    finally:
        stack.stop()
    log = stack.log()
    assert code == 1
    assert "start-up failed: the worker exited with code" in log
    assert "missing.gguf" in log
    assert "kvgrid serve: ready" not in log
