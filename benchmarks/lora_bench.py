"""LoRA's cost on the worker's step: 16 requests spread over 4 adapters against the same 16 on the base model.

    python -m benchmarks.lora_bench [--model PATH] [--dtype float32] [--requests 16] [--adapters 4] [--rank 16]
        [--context 64] [--steps 32] [--rounds 3] [--threads 0] [--device auto] [--out PATH]

One model runner in this process (the embedded SmolLM2-135M by default) with ``--enable-lora``'s slot table of
``--adapters`` slots, and that many random rank-``--rank`` adapters on every projection (q, k, v, o, gate, up, down),
written as PEFT checkpoints in a temporary directory. Two batches of ``--requests`` requests with the same prompts
(``--context`` tokens each): one on the base model, one with request i on adapter i mod ``--adapters``. Each round
prefills both batches, then times ``--steps`` decode steps of each, one batch after the other in the same run; the
rounds alternate which batch goes first. Prints the median step time of each and their ratio (the goal on CPU:
<= 1.3x), for the prefill step and the decode steps. With LoRA on, steps run on the torch path (the native CPU
kernels have no LoRA products, see docs/lora.md), so both batches are measured on it. JSON to
``benchmarks/results/lora_bench.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from benchmarks.results import save
from kvgrid.v1 import common_pb2
from services.common.default_model import default_model_path
from services.worker.lora.manager import build_lora_manager
from services.worker.request_state import RequestState
from services.worker.sampling.request_sampling import RequestSampling
from services.worker.setup.build import create_runner, load_model

TARGETS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


def write_adapter(path: str, args, rank: int, seed: int) -> str:
    """A random PEFT LoRA checkpoint over every projection of ``args``' layers (A and B non-zero)."""
    import json

    from safetensors.torch import save_file

    q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    shapes = {  # module -> (in, out)
        "q_proj": (args.hidden_size, q),
        "k_proj": (args.hidden_size, kv),
        "v_proj": (args.hidden_size, kv),
        "o_proj": (q, args.hidden_size),
        "gate_proj": (args.hidden_size, args.intermediate_size),
        "up_proj": (args.hidden_size, args.intermediate_size),
        "down_proj": (args.intermediate_size, args.hidden_size),
    }
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(args.num_layers):
        for owner, modules in TARGETS.items():
            for module in modules:
                n_in, n_out = shapes[module]
                prefix = f"base_model.model.model.layers.{layer}.{owner}.{module}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) * 0.02
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * 0.02
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(shapes)}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return path


def batch(prompts: list[list[int]], adapters: list[tuple[str, str] | None], block_size: int, first: int, steps: int):
    requests, next_block = [], first
    for i, (prompt, adapter) in enumerate(zip(prompts, adapters, strict=True)):
        num_blocks = -(-(len(prompt) + steps + 2) // block_size)
        state = RequestState(
            request_id=f"r{first}-{i}",
            token_ids=list(prompt),
            num_prompt_tokens=len(prompt),
            block_ids=list(range(next_block, next_block + num_blocks)),
            num_computed_tokens=0,
            sampling=RequestSampling.create(common_pb2.SamplingParams(ignore_eos=True), list(prompt), []),
            num_scheduled_tokens=len(prompt),
            lora=adapter,
        )
        requests.append(state)
        next_block += num_blocks
    return requests, next_block


def timed_steps(runner, requests, steps: int) -> tuple[float, list[float]]:
    """(prefill seconds, each decode step's seconds); the batch's state advances."""
    started = time.perf_counter()
    runner.execute(requests)
    prefill = time.perf_counter() - started
    decode = []
    for _ in range(steps):
        for r in requests:
            r.num_scheduled_tokens = 1
        started = time.perf_counter()
        runner.execute(requests)
        decode.append(time.perf_counter() - started)
    return prefill, decode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_path = args.model or default_model_path()
    loaded = load_model(model_path, dtype=args.dtype, device=args.device, cpu_kernels="torch")
    block_size = 16
    per_request = -(-(args.context + args.steps + 2) // block_size)
    num_blocks = args.requests * per_request
    runner = create_runner(loaded, block_size, num_blocks)
    for k, v in runner.kv_caches:  # touched once here: a first touch's page faults would land on one side only
        k.fill_(0)
        v.fill_(0)
    runner.lora = build_lora_manager(loaded.model, args.adapters, args.adapters, args.rank)
    gen = torch.Generator().manual_seed(0)
    vocab = loaded.args.vocab_size
    prompts = [torch.randint(100, vocab, (args.context,), generator=gen).tolist() for _ in range(args.requests)]
    with tempfile.TemporaryDirectory() as tmp:
        names = [(f"a{i}", write_adapter(f"{tmp}/a{i}", loaded.args, args.rank, i)) for i in range(args.adapters)]
        sides = {"base": [None] * args.requests, "lora": [names[i % args.adapters] for i in range(args.requests)]}
        warm, _ = batch(prompts, sides["lora"], block_size, 0, 2)
        timed_steps(runner, warm, 2)  # loads the adapters into their slots, warms the kernels
        results = {side: {"prefill_s": [], "decode_s": []} for side in sides}
        for round_ in range(args.rounds):
            order = ["base", "lora"] if round_ % 2 == 0 else ["lora", "base"]
            for side in order:
                requests, _ = batch(prompts, sides[side], block_size, 0, args.steps)  # one batch at a time: same blocks
                prefill, decode = timed_steps(runner, requests, args.steps)
                results[side]["prefill_s"].append(prefill)
                results[side]["decode_s"] += decode
    summary = {}
    for side, r in results.items():
        summary[side] = {
            "prefill_ms": 1000 * statistics.median(r["prefill_s"]),
            "decode_step_ms": 1000 * statistics.median(r["decode_s"]),
        }
    ratios = {k: summary["lora"][k] / summary["base"][k] for k in ("prefill_ms", "decode_step_ms")}
    for side, s in summary.items():
        print(f"{side:>5}: prefill {s['prefill_ms']:.1f} ms, decode step {s['decode_step_ms']:.2f} ms")
    print(f"lora / base: prefill {ratios['prefill_ms']:.2f}x, decode step {ratios['decode_step_ms']:.2f}x")
    payload = {
        "model": os.path.basename(model_path),
        "dtype": args.dtype,
        "device": str(loaded.device),
        "requests": args.requests,
        "adapters": args.adapters,
        "rank": args.rank,
        "context": args.context,
        "steps": args.steps,
        "rounds": args.rounds,
        "summary": summary,
        "lora_over_base": ratios,
    }
    save("lora_bench", payload, args.out)


if __name__ == "__main__":
    main()
