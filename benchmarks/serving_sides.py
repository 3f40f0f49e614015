"""The three sides `serving_bench` measures on one workload: the stack, the worker alone, Hugging Face.

A workload is a list of (prompt token ids, output length) with EOS ignored. Each side returns
(output tokens, seconds); only the tokens each request asked for count.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvgrid.cli.bench import FIRST_PLAIN_TOKEN_ID, run_one
from kvgrid.v1 import common_pb2, generate_pb2_grpc
from services.common.server import insecure_channel

Workload = list[tuple[list[int], int]]


@dataclass(slots=True)
class Shape:
    name: str
    concurrency: int
    workload: Workload


def make_workload(rng: random.Random, n: int, prompt: tuple[int, int], output: tuple[int, int], vocab: int) -> Workload:
    """n requests, prompt and output lengths uniform in the given inclusive ranges, random plain tokens."""
    return [
        ([rng.randint(FIRST_PLAIN_TOKEN_ID, vocab - 1) for _ in range(rng.randint(*prompt))], rng.randint(*output))
        for _ in range(n)
    ]


def warm_up(shape: Shape) -> Shape:
    """The shape's first batch of prompts with 8 output tokens each: compiles, allocates, fills caches."""
    return Shape(f"{shape.name} warm-up", shape.concurrency, [(p, 8) for p, _ in shape.workload[: shape.concurrency]])


def run_stack(addr: str, shape: Shape) -> tuple[int, float]:
    """Through the public gRPC API at most ``concurrency`` requests in flight (`kvgrid bench`'s client)."""

    async def go() -> tuple[int, float]:
        async with insecure_channel(addr) as channel:
            stub = generate_pb2_grpc.TextGenerationStub(channel)
            limit = asyncio.Semaphore(shape.concurrency)

            async def bounded(prompt: list[int], n: int):
                async with limit:
                    return await run_one(stub, prompt, n, None)

            start = time.perf_counter()
            results = await asyncio.gather(*(bounded(p, n) for p, n in shape.workload))
            seconds = time.perf_counter() - start
        errors = [r.error for r in results if r.error]
        if errors:
            raise RuntimeError(f"{len(errors)} requests failed, e.g. {errors[0]}")
        return sum(r.output_tokens for r in results), seconds

    return asyncio.run(go())


def run_worker(core, config, shape: Shape) -> tuple[int, float]:
    """The worker's runner under the scheduler's own core, in one process, no gRPC: the same continuous
    batching the stack does, with the same limits and plans of several decode steps sized from the measured
    step times, ``concurrency`` requests admitted at a time."""
    from services.scheduler.convert import plan_to_proto, stop_conditions_from_proto
    from services.scheduler.core import SchedulerCore
    from services.scheduler.request import Request
    from services.worker.request_state import RequestStates
    from services.worker.sampling.request_sampling import RequestSampling

    sched = SchedulerCore.for_worker(core.handshake, config)
    scheduler = sched.scheduler
    runner = core.runner

    def make_sampling(params, prompt, outputs):
        return RequestSampling.create(params, prompt, outputs, default_seed=core.seed)

    states = RequestStates(runner.block_size, runner.num_blocks, core.vocab_size, core.max_model_len, make_sampling)
    pending = list(enumerate(shape.workload))[::-1]
    in_flight, produced = 0, 0
    start = time.perf_counter()
    while pending or scheduler.has_work():
        while pending and in_flight < shape.concurrency:
            i, (prompt, n) = pending.pop()
            sampling = common_pb2.SamplingParams(max_tokens=n, ignore_eos=True)
            scheduler.add_request(Request(f"r{i}", prompt, stop_conditions_from_proto(sampling), sampling))
            in_flight += 1
        out = sched.plan()
        plan = plan_to_proto(out)
        started = time.perf_counter()
        rows, _ = core.execute(plan, states.apply(plan))
        seconds = time.perf_counter() - started
        results = sched.finish_step(out, [(r.request.request_id, r.token_id, None) for r in rows], seconds)
        produced += len(results)
        in_flight -= sum(r.finish is not None for r in results)
    return produced, time.perf_counter() - start


def run_hf(model, shape: Shape, pad_id: int) -> tuple[int, float]:
    """Static batches of ``concurrency`` requests in order, left-padded; a batch runs until its longest
    request is done (``generate`` with EOS off); only the tokens each request asked for count."""
    start, counted = time.perf_counter(), 0
    for first in range(0, len(shape.workload), shape.concurrency):
        batch = shape.workload[first : first + shape.concurrency]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        steps = max(n for _, n in batch)
        with torch.inference_mode():
            model.generate(
                ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                eos_token_id=None, pad_token_id=pad_id,
            )  # fmt: skip
        counted += sum(n for _, n in batch)
    return counted, time.perf_counter() - start


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concurrency", default="1,16,64", help="levels of the equal-length shapes")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-requests", type=int, default=0, help="per level (0: the level, at least 4)")
    parser.add_argument("--mixed-requests", type=int, default=64, help="requests of the mixed shape (0: skip it)")
    parser.add_argument("--mixed-concurrency", type=int, default=64)
    parser.add_argument("--mixed-prompt", default="16-512", help="prompt lengths, uniform in LOW-HIGH")
    parser.add_argument("--mixed-output", default="16-256", help="output lengths, uniform in LOW-HIGH")


def shapes(args: argparse.Namespace, vocab: int) -> list[Shape]:
    rng = random.Random(0)
    out = []
    for c in (int(x) for x in args.concurrency.split(",") if x):
        n = args.num_requests or max(c, 4)
        workload = make_workload(rng, n, (args.input_len,) * 2, (args.output_len,) * 2, vocab)
        out.append(Shape(f"c{c} {args.input_len}/{args.output_len}", c, workload))
    if args.mixed_requests:
        prompt = tuple(int(x) for x in args.mixed_prompt.split("-"))
        output = tuple(int(x) for x in args.mixed_output.split("-"))
        workload = make_workload(rng, args.mixed_requests, prompt, output, vocab)
        out.append(Shape(f"mixed c{args.mixed_concurrency}", args.mixed_concurrency, workload))
    return out


def measure(
    sides: dict[str, Callable[[Shape], tuple[int, float]]], shape: Shape, rounds: int
) -> dict[str, list[float]]:
    """Output tokens/s of each side per round. Every side warms up first; then the sides take turns,
    the order rotating each round, so that a slow spell of the machine falls on each in turn."""
    for run in sides.values():
        run(warm_up(shape))
    names, rates = list(sides), {name: [] for name in sides}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            tokens, seconds = sides[name](shape)
            rates[name].append(tokens / seconds)
            print(f"round {r + 1}  {name:6s} {shape.name}: {tokens / seconds:.1f} tok/s", flush=True)
    return rates


def median_ratio(top: list[float], bottom: list[float]) -> float:
    """The median over rounds of one round's ratio (both sides measured minutes apart at most)."""
    return statistics.median(t / b for t, b in zip(top, bottom, strict=True))
