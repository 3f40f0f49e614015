"""What a structured-output mask costs the unconstrained requests batched with it.

    python -m benchmarks.structured_bench [--companions 3] [--steps 24] [--rounds 3] [--threads 2]

The worker's ModelRunner on the default SmolLM2 (float32, no gRPC) decodes one unconstrained greedy
request next to ``--companions`` other requests, in two batch shapes that differ only in the
companions' constraint: plain greedy companions, and greedy companions under a JSON schema (the
mask is computed by llguidance and applied at the sampler). Every request in a batch advances one
token per step, so the unconstrained request's time per token is the step time. The two shapes run
interleaved for ``--rounds`` rounds; the report is the median step time of each and their ratio,
and the sampler's own share. Absolute figures depend on the machine's load; the ratio is measured
in one process. Writes JSON to ``benchmarks/results/structured_bench.json``.
"""

from __future__ import annotations

import argparse
import json
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
from services.worker.sampling.structured import GrammarCache  # noqa: E402
from services.worker.setup.build import create_runner, load_model  # noqa: E402
from services.worker.setup.loader import load_tokenizer, tokenizer_files  # noqa: E402

BLOCK_SIZE = 16
PROMPT_LEN = 64
# Deep enough that a random walk inside it does not finish within the timed steps.
SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
            },
        }
    },
    "required": ["items"],
}


def build_batch(grammars: GrammarCache, companions: int, constrained: bool, steps: int, vocab: int):
    g = torch.Generator().manual_seed(0)
    blocks_per_seq = -(-(PROMPT_LEN + steps + 4) // BLOCK_SIZE)
    requests = []
    for i in range(companions + 1):
        tokens = torch.randint(256, vocab, (PROMPT_LEN,), generator=g).tolist()
        fields = dict(json_schema=json.dumps(SCHEMA)) if constrained and i > 0 else {}
        params = common_pb2.SamplingParams(**fields)
        sampling = RequestSampling.create(params, tokens, [], constraint=grammars.constraint(params, []))
        requests.append(
            RequestState(
                request_id=f"r{i}",
                token_ids=tokens,
                num_prompt_tokens=PROMPT_LEN,
                block_ids=list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)),
                num_computed_tokens=0,
                sampling=sampling,
                num_scheduled_tokens=PROMPT_LEN,
            )
        )
    return requests


def decode_steps(runner, requests: list[RequestState], steps: int) -> tuple[float, float]:
    """(median step seconds, median sampler seconds) over ``steps`` decode steps after prefill."""
    runner.execute(requests)  # prefill: samples the first token
    step_times, sampler_times = [], []
    sampler = runner.sampler

    def timed_sampler(logits, rows):
        start = time.perf_counter()
        out = sampler(logits, rows)
        sampler_times.append(time.perf_counter() - start)
        return out

    runner.sampler = timed_sampler
    try:
        for _ in range(steps):
            for r in requests:
                r.num_scheduled_tokens = 1
            start = time.perf_counter()
            runner.execute(requests)
            step_times.append(time.perf_counter() - start)
    finally:
        runner.sampler = sampler
    return statistics.median(step_times), statistics.median(sampler_times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--companions", type=int, default=3)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(default_model_path(), dtype="float32", device="cpu")
    vocab = loaded.args.vocab_size
    files = tokenizer_files(load_tokenizer(loaded.source))
    grammars = GrammarCache(files["tokenizer.json"].decode(), vocab, [2])
    num_blocks = (args.companions + 1) * (-(-(PROMPT_LEN + args.steps + 4) // BLOCK_SIZE))
    runner = create_runner(loaded, BLOCK_SIZE, num_blocks)
    results: dict[str, list[tuple[float, float]]] = {"plain": [], "constrained": []}
    for _ in range(args.rounds):
        for shape in results:
            batch = build_batch(grammars, args.companions, shape == "constrained", args.steps, vocab)
            results[shape].append(decode_steps(runner, batch, args.steps))
    summary = {
        "companions": args.companions,
        "steps": args.steps,
        "rounds": args.rounds,
        "threads": torch.get_num_threads(),
    }
    for shape, runs in results.items():
        summary[f"{shape}_step_ms"] = statistics.median(s for s, _ in runs) * 1000
        summary[f"{shape}_sampler_ms"] = statistics.median(s for _, s in runs) * 1000
    summary["step_ratio"] = summary["constrained_step_ms"] / summary["plain_step_ms"]
    print(f"one unconstrained greedy request + {args.companions} companions, {args.steps} decode steps")
    print("| companions | step ms (median) | sampler ms (median) |")
    print("|---|---|---|")
    for shape in results:
        print(f"| {shape} | {summary[f'{shape}_step_ms']:.2f} | {summary[f'{shape}_sampler_ms']:.3f} |")
    print(f"step time with constrained companions / with plain ones: {summary['step_ratio']:.3f}")
    save("structured_bench", summary)


if __name__ == "__main__":
    main()
