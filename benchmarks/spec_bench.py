"""Speculative decoding against none, same run: output tokens per second of greedy generation.

    python -m benchmarks.spec_bench [--model PATH] [--num-requests 8] [--output-len 128] [--rounds 2]
                                    [--speculative-config JSON | --draft-model PATH|target
                                    [--draft-quantization Q]] [--concurrency 1 8]
                                    [--workloads grounded random sampled]

Workloads (greedy, float32 unless --dtype says otherwise):
- grounded: input-grounded chats, the kind n-gram lookup is for: a code file or a document is given in the
  prompt and the answer repeats most of it (rewrite it with one name changed, add comments, summarize by
  quoting). Answers end at EOS or ``--output-len``.
- random: prompts of random token ids, ``--output-len`` tokens each (EOS ignored): nothing in the prompt to
  look up, though a small model's greedy answer soon repeats itself, which n-gram lookup then finds.
- sampled: the random prompts sampled at temperature 1 (seeded per request): the answer rarely repeats, so
  proposals are rare and mostly rejected; this measures what speculation costs when it does not pay. Its
  tokens are not compared (rejection sampling keeps the distribution, not the draws).
Each side is an in-process ``LLM`` (the scheduler core and the worker's runner, as ``kvgrid serve`` runs them
minus the wire). Concurrency c: the requests go in waves of c submitted together. Sides alternate per round
(fresh engines are built once, warmed up), figures are medians over ``--rounds``. Tokens are compared: greedy
output with speculation must equal output without. Writes ``benchmarks/results/spec_bench.json`` (n-gram) or
``spec_bench_<method>.json``.

``--draft-model target --draft-quantization gguf`` measures method draft_model with the pair this machine holds:
the embedded GGUF's blocks kept packed (Q4_1, about a seventh of the float32 target's bytes) drafting for the same
model in float32. A trained draft of the target's family about 10x smaller is the usual pair on larger models.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks.results import save  # noqa: E402
from kvgrid import LLM, SamplingParams  # noqa: E402
from services.common.default_model import default_model_path  # noqa: E402

DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
TASKS = [
    "Rewrite this code with the function `{name}` renamed to `{new}`. Output the whole code.",
    "Add a short comment above each function of this code. Output the whole code.",
    "Copy this text exactly, then fix any typo.",
]


def code_document(rng: random.Random) -> tuple[str, str]:
    """A small Python module of arithmetic helpers and one of its function names."""
    names = rng.sample(["add", "sub", "mul", "scale", "clamp", "mean", "norm", "total", "ratio", "delta"], 4)
    ops = ["a + b", "a - b", "a * b", "max(a, min(b, 10))", "(a + b) / 2", "abs(a) + abs(b)"]
    parts = [f"def {n}(a, b):\n    result = {rng.choice(ops)}\n    return result\n" for n in names]
    return "\n\n".join(parts), names[0]


def grounded_prompts(n: int, seed: int) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    chats = []
    for i in range(n):
        doc, name = code_document(rng)
        task = TASKS[i % len(TASKS)].format(name=name, new=name + "_v2")
        chats.append([{"role": "user", "content": f"{task}\n\n```python\n{doc}```"}])
    return chats


def random_prompts(n: int, seed: int, length: int, vocab_size: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab_size) for _ in range(length)] for _ in range(n)]


def run(llm: LLM, workload: str, prompts: list, output_len: int, concurrency: int) -> tuple[float, list[list[int]]]:
    """Output tokens per second over all waves, and every request's tokens."""
    if workload == "sampled":
        params = [
            SamplingParams(max_tokens=output_len, temperature=1.0, seed=i, ignore_eos=True) for i in range(len(prompts))
        ]
    else:
        params = [SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=workload == "random")] * len(
            prompts
        )
    tokens, seconds = [], 0.0
    for start in range(0, len(prompts), concurrency):
        wave, wave_params = prompts[start : start + concurrency], params[start : start + concurrency]
        began = time.perf_counter()
        if workload == "grounded":
            results = llm.chat(wave, wave_params, use_tqdm=False)
        else:
            results = llm.generate(wave, wave_params, use_tqdm=False)
        seconds += time.perf_counter() - began
        tokens += [r.token_ids for r in results]
    return sum(len(t) for t in tokens) / seconds, tokens


def draft_description(args: argparse.Namespace) -> str:
    name = "the target's own file" if args.draft_model == "target" else pathlib.Path(args.draft_model).name
    return name + (f", --quantization {args.draft_quantization}" if args.draft_quantization else "")


def spec_counts(llm: LLM) -> dict[str, int]:
    stats = llm.engine.core.runner.spec.stats
    return {
        "drafts": stats.num_drafts,
        "draft_tokens": stats.num_draft_tokens,
        "accepted_tokens": stats.num_accepted_tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="HF directory or GGUF file (default: the embedded model)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--speculative-config", default=json.dumps(DEFAULT_SPEC))
    parser.add_argument(
        "--draft-model",
        default="",
        help="method draft_model with this draft (`target`: the target's own file) instead of --speculative-config",
    )
    parser.add_argument("--draft-quantization", default="", help="the draft's weights (none, int8, gguf)")
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--random-input-len", type=int, default=256)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument(
        "--workloads", nargs="+", default=["grounded", "random", "sampled"], choices=["grounded", "random", "sampled"]
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--no-save", action="store_true", help="print the result without writing it")
    args = parser.parse_args()

    options = dict(dtype=args.dtype, kv_cache_memory=args.kv_cache_memory, max_model_len=2048)
    off = LLM(model=args.model or None, **options)
    spec_config = json.loads(args.speculative_config)
    draft = None
    if args.draft_model:
        draft = (args.model or default_model_path()) if args.draft_model == "target" else args.draft_model
        k = spec_config.get("num_speculative_tokens", 4)
        spec_config = {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
        if args.draft_quantization:
            spec_config["quantization"] = args.draft_quantization
    on = LLM(model=args.model or None, speculative_config=spec_config, **options)
    vocab_size = off.engine.core.handshake.vocab_size
    rows = []
    for workload in args.workloads:
        for concurrency in args.concurrency:
            figures: dict[str, list[float]] = {"off": [], "spec": []}
            before = spec_counts(on)
            for round_ in range(args.rounds + 1):  # round 0 warms both up and is not counted
                seed = 1000 * round_ + concurrency
                if workload == "grounded":
                    prompts = grounded_prompts(args.num_requests, seed)
                else:
                    prompts = random_prompts(args.num_requests, seed, args.random_input_len, vocab_size)
                base_rate, base_tokens = run(off, workload, prompts, args.output_len, concurrency)
                spec_rate, spec_tokens = run(on, workload, prompts, args.output_len, concurrency)
                if spec_tokens != base_tokens and workload != "sampled":
                    raise SystemExit(f"{workload} c={concurrency}: speculation changed the greedy output")
                if round_:
                    figures["off"].append(base_rate)
                    figures["spec"].append(spec_rate)
            after = spec_counts(on)
            counts = {k: after[k] - before[k] for k in after}
            row = {
                "workload": workload,
                "concurrency": concurrency,
                "off_tok_s": statistics.median(figures["off"]),
                "spec_tok_s": statistics.median(figures["spec"]),
                "acceptance_rate": counts["accepted_tokens"] / max(counts["draft_tokens"], 1),
                "mean_accepted_per_draft": counts["accepted_tokens"] / max(counts["drafts"], 1),
                **counts,
            }
            row["speedup"] = row["spec_tok_s"] / row["off_tok_s"]
            rows.append(row)
            print(
                f"{workload:8s} c={concurrency:<3d} off {row['off_tok_s']:7.1f} tok/s  spec {row['spec_tok_s']:7.1f}"
                f" tok/s  x{row['speedup']:.2f}  acceptance {row['acceptance_rate']:.2f}",
                flush=True,
            )
    payload = {
        "model": args.model or "SmolLM2-135M-Instruct (embedded)",
        "dtype": args.dtype,
        "speculative_config": spec_config,
        "draft": draft_description(args) if draft else None,
        "num_requests": args.num_requests,
        "output_len": args.output_len,
        "rounds": args.rounds,
        "rows": rows,
    }
    if args.no_save:
        print(json.dumps(payload, indent=2))
    else:
        save("spec_bench" if spec_config["method"] == "ngram" else f"spec_bench_{spec_config['method']}", payload)


if __name__ == "__main__":
    main()
