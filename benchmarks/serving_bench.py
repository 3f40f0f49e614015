"""The whole stack against the worker alone and Hugging Face ``generate``, on the same workloads, in one run.

    python -m benchmarks.serving_bench [--quantization none|int8|gguf] [--dtype float32] [--threads 2]
        [--rounds 3] [--concurrency 1,16,64] [--input-len 32] [--output-len 128] [--mixed-requests 64] [--skip-hf]

Shapes: equal lengths (32 prompt / 128 output tokens, EOS ignored) at each ``--concurrency``,
and a mixed shape (64 concurrent, prompts uniform in 16-512 tokens, outputs in 16-256).
Sides, all set up at once and measured one after the other so that none competes with another
for the cores (the stack idles while the others run):
1. the stack: ``kvgrid serve`` with the default model, driven through the public gRPC API by
   ``kvgrid bench``'s client, at most ``concurrency`` requests in flight;
2. the worker alone: the same model and limits in this process, its runner under the scheduler's
   own core (same continuous batching and plans of several decode steps, no gRPC, no other processes);
3. Hugging Face ``generate`` in float32 from the same GGUF file, static batches of ``concurrency``
   requests (a batch runs until its longest request is done; only requested tokens count).
Each shape runs ``--rounds`` times on every side, the sides taking turns in an order that rotates
each round. Prints the median output tokens/s per side and the median of the rounds' ratios
stack/worker and stack/HF; JSON (every round too) to
``benchmarks/results/serving_bench_<dtype>_<quantization>.json``. On a shared machine absolute numbers
drift (Hugging Face's static batches by a third between runs): compare ratios of one run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

from kvgrid.cli.serve import worker_arrangement

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The worker-alone side runs in this process: the same OpenMP arrangement `kvgrid serve` gives its
# worker, set before torch loads libgomp (which reads it once).
os.environ.update(worker_arrangement(0, len(os.sched_getaffinity(0)), os.environ)[0])

import grpc  # noqa: E402
import torch  # noqa: E402

from benchmarks.results import save  # noqa: E402
from benchmarks.serving_sides import (  # noqa: E402
    Shape,
    add_arguments,
    measure,
    median_ratio,
    run_hf,
    run_stack,
    run_worker,
    shapes,
)
from kvgrid.v1 import generate_pb2, generate_pb2_grpc  # noqa: E402
from services.common import config as cfg  # noqa: E402
from services.common.default_model import default_model_path  # noqa: E402

Side = Callable[[Shape], tuple[int, float]]  # one workload -> (output tokens, seconds)


def stack_flags(args: argparse.Namespace) -> list[str]:
    return [
        "--dtype", args.dtype, "--quantization", args.quantization, "--kv-cache-memory", args.kv_cache_memory,
        "--max-model-len", "1024", "--num-threads", str(args.threads), "--no-enable-prefix-caching",
    ]  # fmt: skip


def open_stack(args: argparse.Namespace, exits: contextlib.ExitStack) -> tuple[int, Side]:
    """Starts `kvgrid serve` (stopped when ``exits`` closes); (vocab size, the side)."""
    from tests.e2e.stack import Stack

    log = Path(tempfile.mkdtemp()) / "serve.log"
    stack = Stack(log, stack_flags(args)).start()
    exits.callback(stack.stop)
    stack.wait_ready()
    with grpc.insecure_channel(stack.addr) as channel:
        info = generate_pb2_grpc.TextGenerationStub(channel).GetModelInfo(generate_pb2.GetModelInfoRequest())
    print("\n".join(line for line in stack.log().splitlines() if "kvgrid serve: worker:" in line), flush=True)
    return info.vocab_size, lambda shape: run_stack(stack.addr, shape)


def open_worker(args: argparse.Namespace) -> Side:
    from services.worker.core import build_core

    parser = argparse.ArgumentParser()
    cfg.add_arguments(parser)
    config = cfg.build_config(args=parser.parse_args(stack_flags(args)), environ={})
    core = build_core(config)
    return lambda shape: run_worker(core, config, shape)


def open_hf() -> Side:
    from transformers import AutoModelForCausalLM

    directory, name = os.path.split(default_model_path())
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    return lambda shape: run_hf(model, shape, pad_id=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantization", default="none", choices=["none", "int8", "gguf"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--rounds", type=int, default=3, help="turns of every side on every shape; medians")
    parser.add_argument("--skip-hf", action="store_true")
    add_arguments(parser)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    torch.set_num_threads(args.threads)
    per_shape = {}
    with contextlib.ExitStack() as exits:
        vocab, stack = open_stack(args, exits)
        sides = {"stack": stack, "worker": open_worker(args)}
        if not args.skip_hf:
            sides["hf"] = open_hf()
        for shape in shapes(args, vocab):
            per_shape[shape.name] = measure(sides, shape, args.rounds)

    setup = f"{args.dtype}, --quantization {args.quantization}, {args.threads} threads, median of {args.rounds} rounds"
    print(f"\nOutput tokens/s, SmolLM2-135M, {setup}\n")
    print("| shape | stack | worker alone | HF generate (fp32, static) | stack / worker | stack / HF |")
    print("|---|---:|---:|---:|---:|---:|")
    rows = []
    for name, rates in per_shape.items():
        s, w = statistics.median(rates["stack"]), statistics.median(rates["worker"])
        h = statistics.median(rates["hf"]) if "hf" in rates else None
        vs_worker = median_ratio(rates["stack"], rates["worker"])
        vs_hf = median_ratio(rates["stack"], rates["hf"]) if h else None
        hf_cells = (f"{h:.1f}", f"{vs_hf:.2f}x") if h else ("-", "-")
        print(f"| {name} | {s:.1f} | {w:.1f} | {hf_cells[0]} | {vs_worker:.2f}x | {hf_cells[1]} |")
        rows.append({"shape": name, "stack_tok_s": s, "worker_tok_s": w, "hf_tok_s": h, "rounds": rates})
        rows[-1].update(stack_over_worker=vs_worker, stack_over_hf=vs_hf)
    save(f"serving_bench_{args.dtype}_{args.quantization}", {"args": vars(args), "results": rows})


if __name__ == "__main__":
    main()
