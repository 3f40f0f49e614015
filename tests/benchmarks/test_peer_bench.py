"""`benchmarks.peer_bench` without llama.cpp: a missing build is a clear error, a dry run prints each level's
commands (one llama-server slot per concurrent request), and its result rows are what the docs table reads."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from benchmarks import peer_bench, tables
from benchmarks.results import ROOT


def bench(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "KVGRID_LLAMA_CPP"} | {"PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "benchmarks.peer_bench", *args]
    return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)


@pytest.fixture
def fake_llama_cpp(tmp_path):
    """A build tree with executables where llama-server and llama-bench go (never run: dry runs only)."""
    bin_dir = tmp_path / "llama.cpp" / "build" / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("llama-server", "llama-bench"):
        (bin_dir / name).write_text("#!/bin/sh\nexit 1\n")
        (bin_dir / name).chmod(0o755)
    return tmp_path / "llama.cpp"


@pytest.fixture
def tiny_gguf(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.context_length", 128)
    writer.add_token_list([f"t{i}" for i in range(1000)])
    writer.add_tensor("token_embd.weight", np.zeros((1000, 4), dtype="float32"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_no_llama_cpp_build_is_a_clear_error(tmp_path):
    proc = bench("--dry-run")
    assert proc.returncode == 2
    assert "pass --llama-cpp-dir or set KVGRID_LLAMA_CPP" in proc.stderr and "Traceback" not in proc.stderr
    proc = bench("--dry-run", "--llama-cpp-dir", str(tmp_path))
    assert proc.returncode == 2
    assert f"llama-server, llama-bench not found in {tmp_path}" in proc.stderr
    assert "cmake --build build --target llama-server llama-bench" in proc.stderr and "Traceback" not in proc.stderr


def test_dry_run_gives_one_llama_server_slot_per_concurrent_request(fake_llama_cpp, tiny_gguf):
    proc = bench("--dry-run", "--llama-cpp-dir", str(fake_llama_cpp), "--model", str(tiny_gguf), "--threads", "2")
    assert proc.returncode == 0, proc.stderr
    levels = proc.stdout.split("requests, at most")
    assert proc.stdout.startswith("c1 32/128: 4 requests, at most 1 in flight")
    assert "c64 32/128: 64 requests, at most 64 in flight" in proc.stdout
    c1, c64 = levels[1], levels[2]
    server = str(fake_llama_cpp / "build" / "bin" / "llama-server")
    assert f"{server} -m {tiny_gguf} --host 127.0.0.1" in c1 and "-np 1 -c 512 -t 2" in c1
    assert "-np 64 -c 32768 -t 2" in c64
    for level in (c1, c64):
        assert f"kvgrid.cli serve --host 127.0.0.1 --model {tiny_gguf} --quantization gguf" in level


def test_the_vllm_side_needs_its_python_and_its_model(fake_llama_cpp):
    proc = bench("--dry-run", "--llama-cpp-dir", str(fake_llama_cpp), "--vllm-python", "python")
    assert proc.returncode == 2 and "--vllm-python and --vllm-model go together" in proc.stderr


def test_vocab_size_is_read_from_the_gguf_header(tiny_gguf, tmp_path):
    assert peer_bench.vocab_size(str(tiny_gguf)) == 1000
    (tmp_path / "other.bin").write_bytes(b"not a gguf")
    with pytest.raises(ValueError, match="not a GGUF file"):
        peer_bench.vocab_size(str(tmp_path / "other.bin"))


def test_result_rows_take_medians_and_per_round_ratios_and_render(tmp_path):
    per_level = {
        "c1 32/128": {"kvgrid": [100.0, 90.0, 120.0], "llama-server": [50.0, 60.0, 40.0]},
        "c64 32/128": {"kvgrid": [300.0, 330.0, 310.0], "llama-server": [100.0, 110.0, 100.0]},
    }
    rows = peer_bench.summarize(per_level, {"c1 32/128": 1, "c64 32/128": 64})
    assert [r["shape"] for r in rows] == ["c1 32/128", "c64 32/128"]
    assert rows[0]["tok_s"] == {"kvgrid": 100.0, "llama-server": 50.0}
    assert rows[0]["over_llama_server"] == {"kvgrid": 2.0}  # median of 2.0, 1.5, 3.0
    assert rows[1]["over_llama_server"] == {"kvgrid": 3.0} and rows[1]["concurrency"] == 64
    payload = {"model": "m.gguf", "llama_bench": [{"test": "pp32", "tok_s": 900.0}, {"test": "tg128", "tok_s": 80.0}]}
    payload |= {"load_average": {"before": [2.0, 2.0, 2.0], "after": [3.0, 3.0, 3.0]}, "results": rows}
    table, headline = tables.peers(payload)
    assert "| c1 32/128 | 100.0 | 50.0 | 2.00× |" in table
    assert any("pp32 900.0 tok/s, tg128 80.0 tok/s" in line for line in table)
    assert headline == "kvgrid against llama-server: 2.00× at c1 32/128, 3.00× at c64 32/128 (m.gguf)"
