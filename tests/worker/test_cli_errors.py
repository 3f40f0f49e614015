"""`kvgrid worker` with a bad model stops with one clear line on stderr and exit code 1, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.worker.tiny import save_tiny_model

pytestmark = pytest.mark.timeout(300)


def _run_worker(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "kvgrid.cli", "worker", "--device", "cpu", "--worker-port", "0"]
    cmd += ["--worker-metrics-port", "0", "--host", "127.0.0.1", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("kvgrid worker: ")]
    assert len(errors) == 1, proc.stderr
    return errors[0]


def test_nonexistent_path():
    line = _one_error_line(_run_worker("--model", "/nonexistent/model"))
    assert "'/nonexistent/model' does not exist" in line


def test_bad_files(tmp_path):
    fake = tmp_path / "broken.gguf"
    fake.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)  # right magic, corrupt header
    assert "broken.gguf" in _one_error_line(_run_worker("--model", str(fake)))
    not_gguf = tmp_path / "weights.gguf"
    not_gguf.write_bytes(b"not a gguf file at all")
    assert "not a GGUF file" in _one_error_line(_run_worker("--model", str(not_gguf)))


def test_corrupt_safetensors_and_unsupported_architecture(tmp_path):
    path = save_tiny_model(str(tmp_path / "tiny"), "llama")
    weights = os.path.join(path, "model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    assert "cannot load the weights" in _one_error_line(_run_worker("--model", path))

    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text('{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}')
    (gpt2 / "model.safetensors").write_bytes(b"")
    assert "'GPT2LMHeadModel' is not supported" in _one_error_line(_run_worker("--model", str(gpt2)))


def test_triton_backend_on_cpu_is_refused_in_one_line():
    env_without_interpreter = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "kvgrid.cli", "worker", "--device", "cpu", "--attention-backend", "triton"]
    cmd += ["--worker-port", "0", "--worker-metrics-port", "0", "--host", "127.0.0.1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env_without_interpreter)
    line = _one_error_line(proc)
    assert "--attention-backend triton" in line and "--attention-backend torch" in line


def test_gguf_quantization_of_a_safetensors_model_is_refused(tmp_path):
    path = save_tiny_model(str(tmp_path / "tiny"), "llama")
    line = _one_error_line(_run_worker("--model", path, "--quantization", "gguf"))
    assert "--quantization gguf" in line and "--quantization int8" in line
