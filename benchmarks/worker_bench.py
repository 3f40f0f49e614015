"""Decode throughput of the worker's forward + sample next to Hugging Face ``generate``, same model, same run.

    python -m benchmarks.worker_bench [--dtype bfloat16] [--batch-sizes 1,16,64] [--steps 32] [--threads 2]
    python -m benchmarks.worker_bench --device cuda --batch-sizes 1,64,256 [--model DIR_OR_GGUF]

kvgrid side: the worker's ModelRunner driven directly (no gRPC): each request is prefilled
(untimed), then ``--steps`` decode steps of the whole batch are timed, each one forward over the
paged KV cache plus batched sampling. Hugging Face side: ``generate`` on a [batch, prompt] tensor
with greedy decoding and no early stop; its decode time is the time for ``steps + 1`` new tokens
minus the time for 1 (the prefill and the first token). Both load the default SmolLM2 GGUF, or
``--model`` (an HF directory or GGUF file). On ``--device cuda`` both sides run on the GPU; each
kvgrid step ends with the sampled ids on the host, so its timing needs no extra synchronisation.
Hugging Face reads the GGUF with its own reader (in transformers 5 it may keep the weights packed
and dequantize inside its matmuls). On a CPU without bfloat16 units kvgrid multiplies bf16 weights
in float32 (see ``services.worker.layers.linear.Linear``); ``--dtype auto`` picks float32 there.
Decode steps take the native CPU kernels (``--cpu-kernels``, ``services.worker.models.llama_cpu``);
the torch path is measured too. ``--quantization int8|gguf`` runs kvgrid on packed weights
(HF stays float).
Prints a markdown table and writes JSON to
``benchmarks/results/worker_bench_<device>_<dtype>_<quantization>.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from benchmarks.results import save  # noqa: E402
from kvgrid.v1 import common_pb2  # noqa: E402
from services.common.default_model import default_model_path  # noqa: E402
from services.worker.request_state import RequestState  # noqa: E402
from services.worker.sampling.request_sampling import RequestSampling  # noqa: E402
from services.worker.setup.build import create_runner, load_model  # noqa: E402

BLOCK_SIZE = 16


def decode_requests(batch: int, prompt_len: int, steps: int, vocab: int) -> list[RequestState]:
    """``batch`` random prompts of ``prompt_len`` tokens, each with blocks for ``steps`` decodes, ready to prefill."""
    g = torch.Generator().manual_seed(batch)
    blocks_per_seq = -(-(prompt_len + steps + 1) // BLOCK_SIZE)
    requests = []
    for i in range(batch):
        tokens = torch.randint(0, vocab, (prompt_len,), generator=g).tolist()
        requests.append(
            RequestState(
                request_id=f"b{i}",
                token_ids=tokens,
                num_prompt_tokens=prompt_len,
                block_ids=list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)),
                num_computed_tokens=0,
                sampling=RequestSampling.create(common_pb2.SamplingParams(), tokens, []),
                num_scheduled_tokens=prompt_len,
            )
        )
    return requests


def kvgrid_decode(runner, batch: int, prompt_len: int, steps: int, vocab: int) -> float:
    """Decode tokens/s of the runner at ``batch`` requests."""
    requests = decode_requests(batch, prompt_len, steps, vocab)
    runner.execute(requests)  # prefill, samples the first token
    for r in requests:  # two untimed warm-up decodes
        r.num_scheduled_tokens = 1
    for _ in range(2):
        runner.execute(requests)
        for r in requests:
            r.num_scheduled_tokens = 1
    start = time.perf_counter()
    for _ in range(steps):
        runner.execute(requests)
        for r in requests:
            r.num_scheduled_tokens = 1
    return batch * steps / (time.perf_counter() - start)


def hf_decode(model, batch: int, prompt_len: int, steps: int, vocab: int) -> float:
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, vocab, (batch, prompt_len), generator=g).to(model.device)
    mask = torch.ones_like(ids)

    def run(new_tokens: int) -> float:
        if ids.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        if ids.is_cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    run(3)  # warm-up
    prefill = min(run(1) for _ in range(2))
    return batch * steps / max(run(steps + 1) - prefill, 1e-9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="measurements of each side, interleaved; medians")
    parser.add_argument("--cpu-kernels", default="auto", choices=["auto", "native", "torch"])
    parser.add_argument("--quantization", default="none", choices=["none", "int8", "gguf"])
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--model", default="", help="HF directory or GGUF file (default: the embedded SmolLM2)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    dtype = getattr(torch, args.dtype)
    model_path = args.model or default_model_path()
    cuda = args.device == "cuda"

    loaded = load_model(
        model_path,
        dtype=args.dtype,
        device=args.device,
        attention_backend="auto" if cuda else "torch",
        cpu_kernels=args.cpu_kernels,
        quantization=args.quantization,
    )
    vocab = loaded.args.vocab_size
    blocks = max(batches) * -(-(args.prompt_len + args.steps + 1) // BLOCK_SIZE)
    runner = create_runner(loaded, BLOCK_SIZE, blocks, seed=0)
    native = loaded.model.native_path
    graphs = None
    if cuda and loaded.attention_backend == "triton":  # as the worker does; eager measured too
        blocks_per_seq = -(-(args.prompt_len + args.steps + 1) // BLOCK_SIZE)
        runner.use_decode_graphs(max(batches), blocks_per_seq * BLOCK_SIZE)
        graphs = runner.graphs
    hf = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        if os.path.isdir(model_path):
            hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        else:
            directory, name = os.path.split(model_path)
            hf = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=dtype)
        hf = hf.to(args.device).eval()

    # Memory bandwidth on a shared machine drifts by tens of percent over minutes: the sides
    # are measured in turns, round after round, and compared by their medians.
    samples: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for b in batches:
            loaded.model.set_native_path(native)
            samples.setdefault(("kvgrid", b), []).append(kvgrid_decode(runner, b, args.prompt_len, args.steps, vocab))
            if native is not None:
                loaded.model.set_native_path(None)
                rate = kvgrid_decode(runner, b, args.prompt_len, args.steps, vocab)
                samples.setdefault(("kvgrid_torch_path", b), []).append(rate)
            if graphs is not None:
                runner.graphs = None
                rate = kvgrid_decode(runner, b, args.prompt_len, args.steps, vocab)
                samples.setdefault(("kvgrid_torch_path", b), []).append(rate)
                runner.graphs = graphs
            if hf is not None:
                samples.setdefault(("hf", b), []).append(hf_decode(hf, b, args.prompt_len, args.steps, vocab))
    loaded.model.set_native_path(native)
    median = {key: statistics.median(values) for key, values in samples.items()}

    rows = []
    where = torch.cuda.get_device_name() if cuda else f"CPU, {args.threads} threads"
    name = os.path.basename(model_path.rstrip("/")) if args.model else "SmolLM2-135M"
    print(f"\nDecode tokens/s, {name} {args.dtype}, {where}, prompt {args.prompt_len},")
    print(
        f"median of {args.rounds} interleaved rounds; native CPU kernels: {'on' if native else 'off'}, "
        f"CUDA graphs: {'on' if graphs else 'off'}\n"
    )
    other = "kvgrid, eager (no CUDA graphs)" if graphs is not None else "kvgrid, torch path"
    print(f"| batch | kvgrid tok/s | {other} | HF generate tok/s | speed-up vs HF |")
    print("|---:|---:|---:|---:|---:|")
    for b in batches:
        ours, torch_path, theirs = median[("kvgrid", b)], median.get(("kvgrid_torch_path", b)), median.get(("hf", b))
        ratio = ours / theirs if theirs else None
        rows.append({"batch": b, "kvgrid_tok_s": ours, "kvgrid_torch_path_tok_s": torch_path})
        rows[-1].update({"hf_tok_s": theirs, "speedup": ratio})
        cells = [f"{ours:.1f}"] + [f"{v:.1f}" if v else "-" for v in (torch_path, theirs)]
        cells.append(f"{ratio:.2f}x" if ratio else "-")
        print(f"| {b} | " + " | ".join(cells) + " |")
    save(
        f"worker_bench_{args.device}_{args.dtype}_{args.quantization}",
        {
            "model": args.model or "SmolLM2-135M-Instruct Q4_1 GGUF",
            "device": where,
            "quantization": args.quantization,
            "dtype": args.dtype,
            "threads": args.threads,
            "prompt_len": args.prompt_len,
            "steps": args.steps,
            "rounds": args.rounds,
            "native_cpu_kernels": native is not None,
            "cuda_graphs": graphs is not None,
            "results": rows,
            "samples": {f"{side}@{b}": v for (side, b), v in samples.items()},
        },
    )


if __name__ == "__main__":
    main()
