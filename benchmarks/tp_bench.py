"""Decode throughput of one worker at tensor-parallel size 1 and N, same model, same run, interleaved.

    python -m benchmarks.tp_bench [--sizes 1,2] [--batch-sizes 1,16] [--steps 32] [--model DIR]

Each size is a worker core built as ``kvgrid worker --tensor-parallel-size N`` builds it (rank 0 in
this process, ranks 1..N-1 spawned), then driven directly (no gRPC) by ``worker_bench``'s decode
loop: prefill untimed, then ``--steps`` timed decode steps of the whole batch. Both sizes stay
loaded and are measured in turns, ``--rounds`` times; medians. On CPU every size runs the torch
decode path (the native kernels do not shard), so size 1 is also given with the kernels it would
use by default. Without ``--model``: a random Llama with SmolLM2-135M's shapes but 8 query / 4 KV
heads (the embedded model's 9 / 3 heads only split 3 ways), written to a temporary directory.
Prints a markdown table and writes JSON to ``benchmarks/results/tp_bench_<device>.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from benchmarks.results import save  # noqa: E402
from benchmarks.worker_bench import kvgrid_decode  # noqa: E402
from services.common.config import build_config  # noqa: E402
from services.worker.core import WorkerCore, build_core  # noqa: E402


def save_smollm_shaped(path: str) -> str:
    from tests.worker.tiny import save_tiny_model, save_tiny_tokenizer

    shape = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, head_dim=72)
    heads = dict(num_attention_heads=8, num_key_value_heads=4)
    save_tiny_model(path, vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=True, **shape, **heads)
    return save_tiny_tokenizer(path)


def core(model: str, args, size: int, cpu_kernels: str) -> WorkerCore:
    environ = {
        "KVGRID_MODEL": model,
        "KVGRID_DTYPE": args.dtype,
        "KVGRID_DEVICE": args.device,
        "KVGRID_KV_CACHE_MEMORY": "512MiB",
        "KVGRID_MAX_MODEL_LEN": "1024",
        "KVGRID_CPU_KERNELS": cpu_kernels,
        "KVGRID_TENSOR_PARALLEL_SIZE": str(size),
        "KVGRID_NUM_THREADS": str(max(1, args.threads // size)),
    }
    return build_core(build_config(environ=environ))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,2")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2, help="CPU threads in all, split between the ranks")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--model", default="", help="HF directory or GGUF file (default: a random SmolLM2 shape)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if sum(n > 1 for n in sizes) > 1:
        parser.error("--sizes: at most one size above 1 (one process group per process)")
    batches = [int(b) for b in args.batch_sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or save_smollm_shaped(tmp)
        variants = {f"tp{n}": (n, "torch") for n in sizes}
        if args.device == "cpu":
            variants["tp1-native"] = (1, "auto")
        cores = {name: core(model, args, n, kernels) for name, (n, kernels) in variants.items()}
        vocab = next(iter(cores.values())).vocab_size
        samples: dict[str, dict[int, list[float]]] = {name: {b: [] for b in batches} for name in cores}
        for _ in range(args.rounds):
            for batch in batches:
                for name, c in cores.items():
                    torch.set_num_threads(max(1, args.threads // variants[name][0]))
                    samples[name][batch].append(kvgrid_decode(c.runner, batch, args.prompt_len, args.steps, vocab))
        for c in cores.values():
            if c.ranks is not None:
                c.ranks.stop()
    medians = {name: {b: statistics.median(v) for b, v in per.items()} for name, per in samples.items()}
    base = f"tp{sizes[0]}"
    print(f"| variant | {' | '.join(f'batch {b} tok/s (vs {base})' for b in batches)} |")
    print(f"|---|{'---|' * len(batches)}")
    for name, per in medians.items():
        cells = [f"{per[b]:.1f} ({per[b] / medians[base][b]:.2f}x)" for b in batches]
        print(f"| {name} | {' | '.join(cells)} |")
    save(f"tp_bench_{args.device}", {"args": vars(args), "tok_s": medians})


if __name__ == "__main__":
    main()
