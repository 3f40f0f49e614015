"""What the service split costs: ``LLM.generate`` in one process against the full stack, same workload, same run.

    python -m benchmarks.offline_bench [--num-requests 64] [--input-len 32] [--output-len 128] [--rounds 2]

Workload: ``--num-requests`` prompts of ``--input-len`` random token ids (``kvgrid bench``'s own prompts,
so the prefix cache cannot help), each generating exactly ``--output-len`` tokens (EOS ignored), all
submitted at once. Sides, each warmed up first:
- offline: one ``LLM.generate`` call over all prompts (scheduler core + model runner in this process);
- stack: ``kvgrid serve`` (three processes) driven by ``kvgrid bench`` at concurrency = number of requests;
- Hugging Face: ``generate`` on the same GGUF model, one batch of all prompts (equal lengths: no padding).
Offline and stack are measured in turns, ``--rounds`` times, each round with fresh prompts; the figures
are medians. stack / offline (output tokens per second) is the overhead of the split.
Writes JSON to ``benchmarks/results/offline_bench.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks.results import save  # noqa: E402
from kvgrid import LLM, SamplingParams  # noqa: E402
from kvgrid.cli import bench as serving_bench  # noqa: E402
from kvgrid.cli.probes import is_serving  # noqa: E402
from services.common.default_model import default_model_path  # noqa: E402

READY_TIMEOUT_S = 600
PORT_FLAGS = ("--tokenizer-port", "--http-port", "--scheduler-port", "--scheduler-metrics-port", "--worker-port")
PORT_FLAGS += ("--worker-metrics-port",)


def workload(args: argparse.Namespace, seed: int, vocab_size: int) -> list[list[int]]:
    bench_args = argparse.Namespace(
        num_requests=args.num_requests, input_len=args.input_len, output_len=args.output_len, range_ratio=0.0, seed=seed
    )
    return [prompt for prompt, _ in serving_bench.make_prompts(bench_args, vocab_size)]


def run_offline(llm: LLM, prompts: list[list[int]], output_len: int) -> float:
    """Output tokens per second of one generate call."""
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    assert all(r.num_completion_tokens == output_len for r in results)
    return sum(r.num_completion_tokens for r in results) / seconds


def start_stack(args: argparse.Namespace, log_path: str) -> tuple[subprocess.Popen, str]:
    socks = [socket.socket() for _ in PORT_FLAGS]
    for sock in socks:
        sock.bind(("127.0.0.1", 0))
    ports = {flag: sock.getsockname()[1] for flag, sock in zip(PORT_FLAGS, socks, strict=True)}
    for sock in socks:
        sock.close()
    argv = [sys.executable, "-m", "kvgrid.cli", "serve", "--host", "127.0.0.1", *stack_flags(args)]
    for flag, port in ports.items():
        argv += [flag, str(port)]
    with open(log_path, "w") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    addr = f"127.0.0.1:{ports['--tokenizer-port']}"
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not is_serving(addr):
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"kvgrid serve did not start; see {log_path}")
        time.sleep(1)
    return process, addr


def stack_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--dtype", args.dtype, "--kv-cache-memory", args.kv_cache_memory, "--max-model-len", "1024"]
    return flags + (["--num-threads", str(args.threads)] if args.threads else [])


def run_stack(addr: str, args: argparse.Namespace, seed: int, num_requests: int, output_len: int) -> float:
    bench_args = argparse.Namespace(
        addr=addr,
        num_requests=num_requests,
        concurrency=num_requests,
        input_len=args.input_len,
        output_len=output_len,
        range_ratio=0.0,
        seed=seed,
        timeout=None,
    )
    summary = asyncio.run(serving_bench.run(bench_args))
    assert summary["failed"] == 0, summary.get("errors")
    return summary["output_throughput"]


def run_hf(args: argparse.Namespace, dtype, vocab_size: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    directory, name = os.path.split(default_model_path())
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=dtype).eval()
    ids = torch.tensor(workload(args, 1000, vocab_size))

    def generate(batch: torch.Tensor, new_tokens: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                batch,
                attention_mask=torch.ones_like(batch),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        return time.perf_counter() - start

    generate(ids[:4], 4)  # warm-up
    return ids.shape[0] * args.output_len / generate(ids, args.output_len)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="offline and stack measured in turns; medians")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--threads", type=int, default=0, help="torch threads on every side (0: torch's default)")
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()

    llm = LLM(dtype=args.dtype, kv_cache_memory=args.kv_cache_memory, max_model_len=1024, num_threads=args.threads)
    core = llm.engine.core
    vocab_size = core.handshake.vocab_size
    dtype_name = core.handshake.dtype
    run_offline(llm, workload(args, 999, vocab_size)[:8], 16)  # warm-up
    process, addr = start_stack(args, os.path.join(tempfile.mkdtemp(prefix="kvgrid-offline-bench-"), "serve.log"))
    samples: dict[str, list[float]] = {"offline": [], "stack": []}
    try:
        run_stack(addr, args, 999, 8, 16)  # warm-up
        for r in range(args.rounds):
            samples["offline"].append(run_offline(llm, workload(args, 2 * r, vocab_size), args.output_len))
            samples["stack"].append(run_stack(addr, args, 2 * r + 1, args.num_requests, args.output_len))
            print(f"round {r + 1}: offline {samples['offline'][-1]:.1f} tok/s, stack {samples['stack'][-1]:.1f} tok/s")
    finally:
        process.terminate()
        process.wait(timeout=60)
    del llm
    if not args.skip_hf:
        import torch

        samples["hf"] = [run_hf(args, getattr(torch, dtype_name), vocab_size)]
    median = {side: statistics.median(values) for side, values in samples.items()}
    overhead = median["stack"] / median["offline"]
    print(f"\n{args.num_requests} x ({args.input_len} in, {args.output_len} out), {dtype_name}, output tokens/s:\n")
    print("| side | output tok/s | vs offline |")
    print("|---|---:|---:|")
    labels = {"offline": "LLM.generate (one process)", "stack": "kvgrid serve + kvgrid bench", "hf": "HF generate"}
    for side, label in labels.items():
        if side in median:
            print(f"| {label} | {median[side]:.1f} | {median[side] / median['offline']:.2f}x |")
    print(f"\nstack / offline = {overhead:.3f} (the split's cost: {100 * (1 - overhead):.1f}% of offline throughput)")
    save(
        "offline_bench",
        {
            "num_requests": args.num_requests,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "dtype": dtype_name,
            "rounds": args.rounds,
            "samples_output_tok_s": samples,
            "median_output_tok_s": median,
            "stack_over_offline": overhead,
        },
    )


if __name__ == "__main__":
    main()
