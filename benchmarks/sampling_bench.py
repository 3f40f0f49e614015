"""Micro-benchmark of the worker's sampler: time per call at SmolLM2's vocabulary.

    python -m benchmarks.sampling_bench [--device cuda] [--rows 64] [--iters 50] [--threads N]

Prints milliseconds per call for an all-greedy batch (the hot path) and for a mixed batch
(temperature, top-k, top-p, min-p, seeds, penalties, logprobs), with requests that persist
across calls and grow their outputs as in decoding. Logits are Gaussian: at scale 6 a 0.95 nucleus
holds a few dozen tokens, like a language model's; at scale 1 it holds most of the vocabulary,
the worst case for top-p (a full sort).
"""

from __future__ import annotations

import argparse
import time

import torch

from kvgrid.v1 import common_pb2
from services.worker.sampling.sampler import RequestSampling, Sampler

VOCAB = 49152

MIXED_KINDS = [
    dict(),
    dict(temperature=0.8, top_p=0.95),
    dict(temperature=0.7, top_k=50),
    dict(temperature=1.0, min_p=0.05, seed=7),
    dict(temperature=0.9, top_p=0.9, top_k=40, seed=11),
    dict(temperature=1.0, frequency_penalty=0.5, presence_penalty=0.3),
    dict(repetition_penalty=1.2),
    dict(temperature=0.6, logprobs=5),
]


def make_requests(rows: int, mixed: bool) -> list[RequestSampling]:
    prompt = list(range(100, 400))
    kinds = MIXED_KINDS if mixed else [dict()]
    return [
        RequestSampling.create(common_pb2.SamplingParams(**kinds[i % len(kinds)]), prompt, [], default_seed=0)
        for i in range(rows)
    ]


def time_per_call(sampler: Sampler, logits: torch.Tensor, requests: list[RequestSampling], iters: int) -> float:
    for _ in range(3):  # warm-up, and penalty state materialised
        sampler(logits, requests)
    if logits.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        out = sampler(logits, requests)  # .tolist() inside synchronises
        for request, token in zip(requests, out.token_ids, strict=True):
            request.append(token)
    return (time.perf_counter() - start) / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sampler = Sampler(VOCAB, device, seed=0)
    noise = torch.randn(args.rows, VOCAB, device=device)
    print(f"device={device} rows={args.rows} vocab={VOCAB} logits=bfloat16 threads={torch.get_num_threads()}")
    for name, mixed, scale in (("greedy", False, 6.0), ("mixed", True, 6.0), ("mixed", True, 1.0)):
        logits = (noise * scale).to(torch.bfloat16)
        seconds = time_per_call(sampler, logits, make_requests(args.rows, mixed), args.iters)
        print(f"{name:>6} (logit scale {scale:g}): {seconds * 1e3:8.3f} ms/call")


if __name__ == "__main__":
    main()
