"""`kvgrid bench`: a serving benchmark against a running stack.

N requests of random token ids (so the prefix cache cannot help), at most C in
flight, each asking for a fixed number of output tokens with EOS ignored.
Reports request and token throughput, time to first token (TTFT), inter-token
latency (ITL: the gap between streamed messages, shared by the tokens a message
carries) and end-to-end latency, as mean and p50/p90/p99.

While it runs, a progress bar on stderr counts finished requests (when stderr is a
terminal, or with --force-tqdm; --disable-tqdm turns it off); stdout carries only
the report.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field

import grpc
from tqdm import tqdm

from kvgrid.cli.connect import (
    add_connection_arguments,
    bad_connection_arguments,
    describe_error,
    metadata,
    open_aio_channel,
)
from kvgrid.cli.generate import closed_stdout
from kvgrid.v1 import common_pb2, generate_pb2, generate_pb2_grpc

# Low ids are special tokens in most vocabularies; random prompts stay above them.
FIRST_PLAIN_TOKEN_ID = 256


@dataclass(slots=True)
class RequestResult:
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if not r.error]
    out: dict = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "input_tokens": sum(r.prompt_tokens for r in ok),
        "output_tokens": sum(r.output_tokens for r in ok),
    }
    out["output_throughput"] = out["output_tokens"] / duration if duration else 0.0
    out["total_token_throughput"] = (out["input_tokens"] + out["output_tokens"]) / duration if duration else 0.0
    series = {
        "ttft_ms": [r.ttft * 1000 for r in ok],
        "itl_ms": [x * 1000 for r in ok for x in r.itls],
        "e2e_ms": [r.e2e * 1000 for r in ok],
    }
    for name, values in series.items():
        out[name] = {"mean": sum(values) / len(values) if values else 0.0}
        out[name].update({f"p{q}": percentile(values, q) for q in (50, 90, 99)})
    errors = sorted({r.error for r in results if r.error})
    if errors:
        out["errors"] = errors
    return out


def format_report(summary: dict) -> str:
    lines = [
        f"{'requests completed':<28}{summary['completed']} ({summary['failed']} failed)",
        f"{'duration':<28}{summary['duration_s']:.2f} s",
        f"{'request throughput':<28}{summary['request_throughput']:.2f} req/s",
        f"{'output token throughput':<28}{summary['output_throughput']:.1f} tok/s",
        f"{'total token throughput':<28}{summary['total_token_throughput']:.1f} tok/s",
        f"{'input / output tokens':<28}{summary['input_tokens']} / {summary['output_tokens']}",
        f"{'':<12}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}  (ms)",
    ]
    for name, label in (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
        s = summary[name]
        lines.append(f"{label:<12}{s['mean']:>10.1f}{s['p50']:>10.1f}{s['p90']:>10.1f}{s['p99']:>10.1f}")
    lines += [f"error: {e}" for e in summary.get("errors", [])]
    return "\n".join(lines)


def make_prompts(args: argparse.Namespace, vocab_size: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) per request, lengths spread by --range-ratio around the means."""
    rng = random.Random(args.seed)

    def length(mean: int) -> int:
        return max(1, rng.randint(int(mean * (1 - args.range_ratio)), int(mean * (1 + args.range_ratio))))

    top = vocab_size - 1
    low = min(FIRST_PLAIN_TOKEN_ID, top)
    return [
        ([rng.randint(low, top) for _ in range(length(args.input_len))], length(args.output_len))
        for _ in range(args.num_requests)
    ]


async def run_one(stub, prompt: list[int], max_tokens: int, timeout: float | None, call_metadata=()) -> RequestResult:
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    request = generate_pb2.GenerateRequest(prompt_token_ids=prompt, sampling=sampling)
    result = RequestResult(prompt_tokens=len(prompt))
    start = last = time.perf_counter()
    try:
        async for response in stub.Generate(request, timeout=timeout, metadata=call_metadata):
            now = time.perf_counter()
            n = len(response.token_ids)
            if n and result.output_tokens == 0:
                result.ttft = now - start
            elif n:
                result.itls += [(now - last) / n] * n
            if n:
                result.output_tokens += n
                last = now
            if response.usage.prompt_tokens:
                result.prompt_tokens = response.usage.prompt_tokens
    except grpc.aio.AioRpcError as err:
        result.error = f"{err.code().name}: {err.details()}"
    result.e2e = time.perf_counter() - start
    return result


async def run(args: argparse.Namespace) -> dict:
    call_metadata = metadata(args)
    async with open_aio_channel(args) as channel:
        stub = generate_pb2_grpc.TextGenerationStub(channel)
        info = await stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=10, metadata=call_metadata)
        prompts = make_prompts(args, info.vocab_size)
        limit = asyncio.Semaphore(args.concurrency)
        bar = tqdm(total=len(prompts), desc="requests", unit="req", file=sys.stderr, disable=progress_disabled(args))

        async def bounded(prompt: list[int], max_tokens: int) -> RequestResult:
            async with limit:
                result = await run_one(stub, prompt, max_tokens, args.timeout, call_metadata)
            bar.update(1)
            return result

        start = time.perf_counter()
        try:
            results = await asyncio.gather(*(bounded(p, n) for p, n in prompts))
            duration = time.perf_counter() - start
        finally:
            bar.close()
    summary = summarize(list(results), duration)
    summary.update(model=info.model, num_requests=args.num_requests, concurrency=args.concurrency)
    summary.update(input_len=args.input_len, output_len=args.output_len)
    return summary


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgrid bench", description="Serving benchmark against a running stack.")
    parser.add_argument("-n", "--num-requests", type=int, default=64, help="requests to send (64)")
    parser.add_argument("-c", "--concurrency", type=int, default=8, help="most requests in flight (8)")
    parser.add_argument("--input-len", type=int, default=128, help="mean prompt length in tokens (128)")
    parser.add_argument("--output-len", type=int, default=128, help="mean output length in tokens (128)")
    parser.add_argument("--range-ratio", type=float, default=0.0, help="lengths vary uniformly by ± this share (0)")
    parser.add_argument("--seed", type=int, default=0, help="seed for the random prompts (0)")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    progress = parser.add_mutually_exclusive_group()
    progress.add_argument("--disable-tqdm", action="store_true", help="no progress bar on stderr")
    progress.add_argument(
        "--force-tqdm", action="store_true", help="a progress bar on stderr even when it is not a terminal"
    )
    add_connection_arguments(parser)
    return parser


def progress_disabled(args: argparse.Namespace) -> bool | None:
    """tqdm's `disable`: None leaves it to tqdm, which shows the bar only when stderr is a terminal."""
    if args.disable_tqdm:
        return True
    return False if args.force_tqdm else None


def validate(args: argparse.Namespace) -> list[str]:
    problems = []
    for name in ("num_requests", "concurrency", "input_len", "output_len"):
        if getattr(args, name) < 1:
            problems.append(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= args.range_ratio < 1:
        problems.append("--range-ratio must be in [0, 1)")
    return problems


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    problems = validate(args)
    if problems:
        for line in problems:
            print(f"kvgrid bench: {line}", file=sys.stderr)
        return 2
    bad = bad_connection_arguments("bench", args)
    if bad is not None:
        return bad
    try:
        summary = asyncio.run(run(args))
    except grpc.aio.AioRpcError as err:
        print(f"kvgrid bench: {describe_error(err, args.addr)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("kvgrid bench: interrupted", file=sys.stderr)
        return 130
    try:
        print(json.dumps(summary) if args.json else format_report(summary), flush=True)
    except BrokenPipeError:
        return closed_stdout()
    return 0 if summary["failed"] == 0 else 1
