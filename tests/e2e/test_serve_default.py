"""`kvgrid serve` as `make serve` runs it (only ports and the KV cache size overridden), and the shell clients."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.e2e.stack import Stack, child_env, pid_alive

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def default_stack(tmp_path_factory):
    # float32: `--dtype auto` is bfloat16 on CPUs with AVX512-BF16, where the chat prompt's first token is a
    # coin toss ("The" leads "L" by 0.09 in float32 logits, under one bfloat16 step at 25; "L" goes on
    # "L'Etoile, ..."), decided by rounding: cached or not, which attention kernel. The CLI is what these test.
    args = ["--kv-cache-memory", "512MiB", "--dtype", "float32"]
    stack = Stack(tmp_path_factory.mktemp("default") / "serve.log", args).start()
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
