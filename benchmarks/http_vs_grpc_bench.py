"""The cost of the OpenAI HTTP API over the gRPC API: the same streaming workload through both.

    python -m benchmarks.http_vs_grpc_bench [--serve] [-n 32] [-c 8] [--input-len 64] [--output-len 64] [--rounds 2]

Each round sends ``-n`` requests of random token ids (EOS ignored, exactly ``--output-len`` tokens
each), at most ``-c`` at a time, once as gRPC ``Generate`` streams (``kvgrid bench``'s client) and
once as streamed ``/v1/completions`` through the official ``openai`` client (AsyncOpenAI); the
transports alternate so both see the same machine load. Reported per transport: output tokens/s,
TTFT p50/p99 (to the first token-carrying message or chunk), ITL p50, with the median over rounds
and the HTTP/gRPC ratios. ``--serve`` starts its own ``kvgrid serve`` (float32 by default) on free
ports; otherwise ``--addr`` and ``--base-url`` name a running stack. Writes JSON to
``benchmarks/results/http_vs_grpc_bench.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time

from openai import AsyncOpenAI

from benchmarks.control_plane_bench import _free_ports as free_ports
from benchmarks.results import save
from kvgrid.cli.bench import RequestResult, make_prompts, run_one, summarize
from kvgrid.v1 import generate_pb2, generate_pb2_grpc
from services.common.server import insecure_channel

SERVE_ARGS = ["--dtype", "float32", "--kv-cache-memory", "512MiB", "--max-model-len", "1024"]


async def run_one_http(client: AsyncOpenAI, model: str, prompt: list[int], max_tokens: int) -> RequestResult:
    result = RequestResult(prompt_tokens=len(prompt))
    start = last = time.perf_counter()
    try:
        stream = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            now = time.perf_counter()
            if not chunk.choices or not chunk.choices[0].text:
                continue
            if result.output_tokens == 0:
                result.ttft = now - start
            else:
                result.itls.append(now - last)
            result.output_tokens += 1  # refined from usage below: a chunk may carry several tokens
            last = now
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        result.error = f"{type(exc).__name__}: {exc}"
    result.e2e = time.perf_counter() - start
    if not result.error:
        result.output_tokens = max_tokens  # ignore_eos: exactly max_tokens
    return result


async def one_round(args, transport: str, prompts: list[tuple[list[int], int]]) -> dict:
    limit = asyncio.Semaphore(args.concurrency)
    if transport == "grpc":
        async with insecure_channel(args.addr) as channel:
            stub = generate_pb2_grpc.TextGenerationStub(channel)

            async def one(prompt, n):
                async with limit:
                    return await run_one(stub, prompt, n, None)

            start = time.perf_counter()
            results = await asyncio.gather(*(one(p, n) for p, n in prompts))
    else:
        async with AsyncOpenAI(base_url=args.base_url, api_key="unused", max_retries=0, timeout=600) as client:
            model = (await client.models.list()).data[0].id

            async def one(prompt, n):
                async with limit:
                    return await run_one_http(client, model, prompt, n)

            start = time.perf_counter()
            results = await asyncio.gather(*(one(p, n) for p, n in prompts))
    return summarize(list(results), time.perf_counter() - start)


async def measure(args) -> dict:
    async with insecure_channel(args.addr) as channel:
        info = await generate_pb2_grpc.TextGenerationStub(channel).GetModelInfo(generate_pb2.GetModelInfoRequest())
    prompts = make_prompts(args, info.vocab_size)
    await one_round(args, "grpc", prompts[: args.concurrency])  # warm-up: kernels, connections
    await one_round(args, "http", prompts[: args.concurrency])
    rounds: dict[str, list[dict]] = {"grpc": [], "http": []}
    for _ in range(args.rounds):
        for transport in rounds:
            rounds[transport].append(await one_round(args, transport, prompts))
    out: dict = {"model": info.model, "num_requests": args.num_requests, "concurrency": args.concurrency}
    out.update(input_len=args.input_len, output_len=args.output_len, rounds=args.rounds)
    for transport, summaries in rounds.items():
        failed = sum(s["failed"] for s in summaries)
        out[transport] = {
            "output_tok_s": statistics.median(s["output_throughput"] for s in summaries),
            "ttft_p50_ms": statistics.median(s["ttft_ms"]["p50"] for s in summaries),
            "ttft_p99_ms": statistics.median(s["ttft_ms"]["p99"] for s in summaries),
            "itl_p50_ms": statistics.median(s["itl_ms"]["p50"] for s in summaries),
            "failed": failed,
        }
    out["http_over_grpc"] = {
        k: out["http"][k] / out["grpc"][k] for k in out["grpc"] if k != "failed" and out["grpc"][k]
    }
    return out


def start_stack(extra: list[str]) -> tuple[subprocess.Popen, str, str]:
    flags = ["--tokenizer-port", "--http-port", "--scheduler-port", "--scheduler-metrics-port", "--worker-port"]
    flags.append("--worker-metrics-port")
    ports = dict(zip(flags, free_ports(len(flags)), strict=True))
    argv = [sys.executable, "-m", "kvgrid.cli", "serve", "--host", "127.0.0.1", *extra]
    for flag, port in ports.items():
        argv += [flag, str(port)]
    log_path = pathlib.Path(tempfile.mkdtemp()) / "serve.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    while not re.search(r"kvgrid serve: ready", log_path.read_text()):
        if proc.poll() is not None:
            raise RuntimeError(f"kvgrid serve exited; see {log_path}")
        time.sleep(0.5)
    return proc, f"127.0.0.1:{ports['--tokenizer-port']}", f"http://127.0.0.1:{ports['--http-port']}/v1"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--num-requests", type=int, default=32)
    parser.add_argument("-c", "--concurrency", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--range-ratio", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--addr", default="localhost:50051", help="gRPC address of a running stack")
    parser.add_argument("--base-url", default="http://localhost:8000/v1", help="its OpenAI base URL")
    parser.add_argument("--serve", action="store_true", help="start a `kvgrid serve` for the run")
    args = parser.parse_args()
    proc = None
    if args.serve:
        proc, args.addr, args.base_url = start_stack(SERVE_ARGS)
    try:
        out = asyncio.run(measure(args))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    print(f"{args.num_requests} requests, {args.concurrency} at a time, {args.input_len} in / {args.output_len} out")
    print("| transport | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms |")
    print("|---|---|---|---|---|")
    for transport in ("grpc", "http", "http_over_grpc"):
        s = out[transport]
        label = "HTTP / gRPC" if transport == "http_over_grpc" else transport
        print(
            f"| {label} | "
            + " | ".join(f"{s[k]:.3g}" for k in ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms"))
            + " |"
        )
    save("http_vs_grpc_bench", out)


if __name__ == "__main__":
    main()
