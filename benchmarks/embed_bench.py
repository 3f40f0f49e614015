"""Embeddings per second through the stack (``--runner pooling``) against ``transformers`` batched, in one run.

    python -m benchmarks.embed_bench [--inputs 256] [--lengths 16-128] [--pooling-type last] [--threads 2]
        [--rounds 3] [--hf-batch 32] [--concurrency 8]

Workload: ``--inputs`` prompts of random plain token ids, lengths uniform in ``--lengths`` (a fixed seed), the
embedded SmolLM2-135M in float32, ``--pooling-type`` pooling, normalized. Sides, measured one after the other so
that none competes with another for the cores (the stack idles while transformers runs):
1. the stack: ``kvgrid serve --runner pooling``, the inputs sent to ``POST /v1/embeddings`` as token ids in
   ``--concurrency`` concurrent requests of equal share (OpenAI's client's base64 encoding);
2. ``transformers``: ``AutoModel`` (the model without its LM head) from the same GGUF file, the inputs sorted by
   length (as sentence-transformers does) in batches of ``--hf-batch``, right-padded with an attention mask, the
   last hidden states pooled the same way.
Each side warms up on a slice of the inputs, then the sides take turns for ``--rounds`` rounds. Prints the
median embeddings/s and prompt tokens/s per side, the median of the rounds' stack/transformers ratios, and the
lowest cosine similarity between the two sides' vectors (a check that both computed the same thing). JSON (every
round too) to ``benchmarks/results/embed_bench.json``.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import random
import statistics
import struct
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvgrid.cli.serve import worker_arrangement

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# transformers runs in this process: the OpenMP arrangement `kvgrid serve` gives its worker.
os.environ.update(worker_arrangement(0, len(os.sched_getaffinity(0)), os.environ)[0])

import torch  # noqa: E402

from benchmarks.results import save  # noqa: E402
from kvgrid.cli.bench import FIRST_PLAIN_TOKEN_ID  # noqa: E402
from services.common.default_model import default_model_path  # noqa: E402

Inputs = list[list[int]]


def stack_flags(args: argparse.Namespace) -> list[str]:
    return [
        "--runner", "pooling", "--pooling-type", args.pooling_type, "--dtype", "float32",
        "--kv-cache-memory", "1GiB", "--max-model-len", "1024", "--num-threads", str(args.threads),
        "--no-enable-prefix-caching",
    ]  # fmt: skip


def post_embeddings(url: str, inputs: Inputs) -> list[list[float]]:
    body = json.dumps({"input": inputs, "encoding_format": "base64"}).encode()
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=1800) as response:
        data = json.loads(response.read())["data"]
    vectors = []
    for item in data:
        raw = base64.b64decode(item["embedding"])
        vectors.append(list(struct.unpack(f"<{len(raw) // 4}f", raw)))
    return vectors


def run_stack(url: str, inputs: Inputs, concurrency: int) -> list[list[float]]:
    """``concurrency`` requests in flight, each a contiguous share of the inputs; vectors in input order."""
    share = -(-len(inputs) // concurrency)
    parts = [inputs[i : i + share] for i in range(0, len(inputs), share)]
    with ThreadPoolExecutor(len(parts)) as pool:
        answers = list(pool.map(lambda part: post_embeddings(url, part), parts))
    return [vector for answer in answers for vector in answer]


def run_hf(model, inputs: Inputs, batch_size: int, pooling_type: str) -> list[list[float]]:
    order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
    vectors: list[list[float] | None] = [None] * len(inputs)
    for first in range(0, len(order), batch_size):
        batch = order[first : first + batch_size]
        lengths = torch.tensor([len(inputs[i]) for i in batch])
        width = int(lengths.max())
        ids = torch.tensor([inputs[i] + [0] * (width - len(inputs[i])) for i in batch])
        mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
        with torch.inference_mode():
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, W, E]
            if pooling_type == "last":
                pooled = hidden[torch.arange(len(batch)), lengths - 1]
            elif pooling_type == "mean":
                pooled = (hidden * mask[..., None]).sum(dim=1) / lengths[:, None]
            else:
                pooled = hidden[:, 0]
            pooled = torch.nn.functional.normalize(pooled.float(), dim=-1)
        for i, vector in zip(batch, pooled.tolist(), strict=True):
            vectors[i] = vector
    return vectors


def min_cosine(a: list[list[float]], b: list[list[float]]) -> float:
    x, y = torch.tensor(a), torch.tensor(b)
    return torch.nn.functional.cosine_similarity(x, y, dim=-1).min().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=256)
    parser.add_argument("--lengths", default="16-128", help="prompt lengths in tokens, uniform in LOW-HIGH")
    parser.add_argument("--pooling-type", default="last", choices=["last", "mean", "cls"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="turns of each side; medians")
    parser.add_argument("--hf-batch", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8, help="concurrent /v1/embeddings requests")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    low, high = (int(n) for n in args.lengths.split("-"))
    rng = random.Random(0)
    directory, name = os.path.split(default_model_path())

    from transformers import AutoModel

    from tests.e2e.stack import Stack

    model = AutoModel.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    inputs = [
        [rng.randint(FIRST_PLAIN_TOKEN_ID, vocab - 1) for _ in range(rng.randint(low, high))]
        for _ in range(args.inputs)
    ]
    num_tokens = sum(map(len, inputs))
    rates: dict[str, list[float]] = {"stack": [], "hf": []}
    vectors = {}
    with contextlib.ExitStack() as exits:
        stack = Stack(Path(tempfile.mkdtemp()) / "serve.log", stack_flags(args)).start()
        exits.callback(stack.stop)
        stack.wait_ready()
        url = f"http://127.0.0.1:{stack.ports['--http-port']}/v1/embeddings"
        sides = {
            "stack": lambda batch: run_stack(url, batch, args.concurrency),
            "hf": lambda batch: run_hf(model, batch, args.hf_batch, args.pooling_type),
        }
        for run in sides.values():
            run(inputs[: args.hf_batch])  # warm-up
        names = list(sides)
        for r in range(args.rounds):
            for side in names[r % 2 :] + names[: r % 2]:
                start = time.perf_counter()
                vectors[side] = sides[side](inputs)
                seconds = time.perf_counter() - start
                rates[side].append(len(inputs) / seconds)
                print(f"round {r + 1}  {side:5s}: {len(inputs) / seconds:.1f} embeddings/s", flush=True)
    stack_rate, hf_rate = statistics.median(rates["stack"]), statistics.median(rates["hf"])
    ratio = statistics.median(s / h for s, h in zip(rates["stack"], rates["hf"], strict=True))
    cosine = min_cosine(vectors["stack"], vectors["hf"])
    print(f"\nSmolLM2-135M float32, {args.inputs} inputs of {args.lengths} tokens ({num_tokens} in all), "
          f"{args.pooling_type} pooling, {args.threads} threads, median of {args.rounds} rounds\n")  # fmt: skip
    print("| side | embeddings/s | prompt tokens/s |\n|---|---:|---:|")
    print(f"| stack (/v1/embeddings) | {stack_rate:.1f} | {stack_rate * num_tokens / args.inputs:.0f} |")
    print(f"| transformers batched | {hf_rate:.1f} | {hf_rate * num_tokens / args.inputs:.0f} |")
    print(f"\nstack / transformers: {ratio:.2f}x; lowest cosine between the sides' vectors: {cosine:.6f}")
    result = {
        "inputs": args.inputs,
        "num_prompt_tokens": num_tokens,
        "stack_embeddings_per_s": stack_rate,
        "hf_embeddings_per_s": hf_rate,
        "stack_over_hf": ratio,
        "min_cosine": cosine,
        "rounds": rates,
    }
    save("embed_bench", {"args": vars(args), "result": result})


if __name__ == "__main__":
    main()
