"""The whole stack against the worker alone and Hugging Face ``generate``, on the same workloads, in one run.

    python -m benchmarks.serving_bench [--quantization none|int8|gguf] [--dtype float32] [--threads 2]
        [--concurrency 1,16,64] [--input-len 32] [--output-len 128] [--mixed-requests 64] [--skip-hf]

Shapes: equal lengths (32 prompt / 128 output tokens, EOS ignored) at each ``--concurrency``,
and a mixed shape (64 concurrent, prompts uniform in 16-512 tokens, outputs in 16-256).
Sides, measured one after the other so that none competes with another for the cores:
1. the stack: ``kvgrid serve`` with the default model, driven through the public gRPC API by
   ``kvgrid bench``'s client, at most ``concurrency`` requests in flight;
2. the worker alone: the same model and limits in this process, its runner under the scheduler's
   own core (same continuous batching, no gRPC, no other processes);
3. Hugging Face ``generate`` in float32 from the same GGUF file, static batches of ``concurrency``
   requests (a batch runs until its longest request is done; only requested tokens count).
Prints output tokens/s per side and the ratios stack/worker and stack/HF; JSON to
``benchmarks/results/serving_bench_<quantization>.json``. On a shared machine absolute numbers
drift; the ratios of one run are what to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile

from kvgrid.threads import worker_arrangement

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The worker-alone side runs in this process: the same OpenMP arrangement `kvgrid serve` gives its
# worker, set before torch loads libgomp (which reads it once).
os.environ.update(worker_arrangement(0, len(os.sched_getaffinity(0)), os.environ)[0])

import grpc  # noqa: E402
import torch  # noqa: E402

from benchmarks.serving_sides import add_arguments, run_hf, run_stack, run_worker, shapes, warm_up  # noqa: E402
from kvgrid.v1 import generate_pb2, generate_pb2_grpc  # noqa: E402
from services.common import config as cfg  # noqa: E402
from services.common.default_model import default_model_path  # noqa: E402

RESULTS = os.path.join(os.path.dirname(__file__), "results", "serving_bench_{quantization}.json")


def stack_flags(args: argparse.Namespace) -> list[str]:
    return [
        "--dtype", args.dtype, "--quantization", args.quantization, "--kv-cache-memory", args.kv_cache_memory,
        "--max-model-len", "1024", "--num-threads", str(args.threads), "--no-enable-prefix-caching",
    ]  # fmt: skip


def measure_stack(args: argparse.Namespace) -> tuple[int, dict[str, tuple[int, float]]]:
    from pathlib import Path

    from tests.e2e.stack import Stack

    log = Path(tempfile.mkdtemp()) / "serve.log"
    stack = Stack(log, stack_flags(args)).start()
    try:
        stack.wait_ready()
        with grpc.insecure_channel(stack.addr) as channel:
            info = generate_pb2_grpc.TextGenerationStub(channel).GetModelInfo(generate_pb2.GetModelInfoRequest())
        arrangement = [line for line in stack.log().splitlines() if "kvgrid serve: worker:" in line]
        print("\n".join(arrangement), flush=True)
        results = {}
        for shape in shapes(args, info.vocab_size):
            run_stack(stack.addr, warm_up(shape))
            results[shape.name] = run_stack(stack.addr, shape)
            print(f"stack   {shape.name}: {results[shape.name][0] / results[shape.name][1]:.1f} tok/s", flush=True)
        return info.vocab_size, results
    finally:
        stack.stop()


def measure_worker(args: argparse.Namespace, vocab: int) -> dict[str, tuple[int, float]]:
    from services.worker.core import build_core

    parser = argparse.ArgumentParser()
    cfg.add_arguments(parser)
    config = cfg.build_config(args=parser.parse_args(stack_flags(args)), environ={})
    core = build_core(config)
    results = {}
    for shape in shapes(args, vocab):
        run_worker(core, config, warm_up(shape))
        results[shape.name] = run_worker(core, config, shape)
        print(f"worker  {shape.name}: {results[shape.name][0] / results[shape.name][1]:.1f} tok/s", flush=True)
    return results


def measure_hf(args: argparse.Namespace, vocab: int) -> dict[str, tuple[int, float]]:
    from transformers import AutoModelForCausalLM

    directory, name = os.path.split(default_model_path())
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    results = {}
    for shape in shapes(args, vocab):
        results[shape.name] = run_hf(model, shape, pad_id=0)
        print(f"hf      {shape.name}: {results[shape.name][0] / results[shape.name][1]:.1f} tok/s", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantization", default="none", choices=["none", "int8", "gguf"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--skip-hf", action="store_true")
    add_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    vocab, stack = measure_stack(args)
    worker = measure_worker(args, vocab)
    hf = {} if args.skip_hf else measure_hf(args, vocab)

    rate = {side: {k: n / s for k, (n, s) in res.items()} for side, res in (("stack", stack), ("worker", worker))}
    rate["hf"] = {k: n / s for k, (n, s) in hf.items()}
    setup = f"{args.dtype}, --quantization {args.quantization}, {args.threads} threads"
    print(f"\nOutput tokens/s, SmolLM2-135M, {setup}\n")
    print("| shape | stack | worker alone | HF generate (fp32, static) | stack / worker | stack / HF |")
    print("|---|---:|---:|---:|---:|---:|")
    rows = []
    for name, s in rate["stack"].items():
        w, h = rate["worker"][name], rate["hf"].get(name)
        vs_hf = f"{s / h:.2f}x" if h else "-"
        print(f"| {name} | {s:.1f} | {w:.1f} | {f'{h:.1f}' if h else '-'} | {s / w:.2f}x | {vs_hf} |")
        rows.append({"shape": name, "stack_tok_s": s, "worker_tok_s": w, "hf_tok_s": h, "stack_over_worker": s / w})
        rows[-1]["stack_over_hf"] = s / h if h else None
    path = RESULTS.format(quantization=args.quantization)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(
            {"benchmark": "serving", "args": vars(args), "torch": torch.__version__,
             "machine": platform.processor() or platform.machine(), "results": rows},
            f, indent=2,
        )  # fmt: skip
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
