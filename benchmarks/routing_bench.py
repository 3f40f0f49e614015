"""Round-robin against kvgrid's cache-aware routing over two worker groups, on one workload, in one run.

    python -m benchmarks.routing_bench [--users 32] [--requests-per-user 8] [--system-len 384] [--system-prompts 0]
        [--question-len 16] [--output-len 16] [--kv-cache-memory BYTES] [--model DIR] [--rounds 2]
        [--routing-args "--routing-load-weight 0.5 ..."]

Two scheduler+worker groups start once; two frontends route over both, one with
``--routing-policy round-robin``, one with the default (prefix overlap and load). Each
phase runs the same shape with its own prompts (so none finds another's cache), the
policies alternating A-B-B-A over ``--rounds`` phases each:
every user has its own long system prompt and sends its requests one after the other
(system prompt + a new question each), all users at once. The KV cache of a group is
sized to hold about two thirds of all system prompts: round-robin makes both groups
cache every user's prompt and evict, routing by prefix keeps each user on one group.
Reported per phase: prefix-cache hit rate (from the groups' GetStats), request and
token throughput, TTFT p50/p99; then the ratios cache-aware / round-robin. JSON to
``benchmarks/results/routing_bench.json``. The model is a random Llama (hidden 256,
4 layers, float32 on CPU) unless ``--model`` names one; absolute numbers drift on a
shared machine, the ratios of one run are what to compare. ``--system-prompts 1`` (everyone
shares one prompt) checks the other side: prefix affinity alone would pile every request
on one group, and the load balance has to spread them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import random
import tempfile
import time
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks.results import save  # noqa: E402
from kvgrid.cli.bench import percentile, run_one  # noqa: E402
from kvgrid.v1 import generate_pb2_grpc  # noqa: E402
from services.common.server import insecure_channel  # noqa: E402

MODEL_SHAPE = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=2048,
)


def workload(seed: int, args) -> list[list[list[int]]]:
    """Per user, the prompts of its requests in order."""
    rng = random.Random(seed)
    systems = [
        [rng.randrange(5, 150) for _ in range(args.system_len)] for _ in range(args.system_prompts or args.users)
    ]
    users = []
    for i in range(args.users):
        system = systems[i % len(systems)]
        users.append([system + [rng.randrange(5, 150) for _ in range(args.question_len)] for _ in range(args.rpu)])
    return users


async def run_phase(addr: str, users: list[list[list[int]]], output_len: int) -> tuple[list, float]:
    async with insecure_channel(addr) as channel:
        stub = generate_pb2_grpc.TextGenerationStub(channel)

        async def user(prompts):
            return [await run_one(stub, prompt, output_len, 300) for prompt in prompts]

        start = time.perf_counter()
        per_user = await asyncio.gather(*(user(prompts) for prompts in users))
        duration = time.perf_counter() - start
    return per_user, duration


@dataclass
class Phase:
    per_user: list  # per user, its RequestResults in order
    duration: float
    queries: list[int]  # prompt tokens each group looked up in its prefix cache
    hits: list[int]  # of those, tokens found


def run_policy(frontend, groups, users, output_len: int) -> Phase:
    before = [g.stats() for g in groups]
    per_user, duration = asyncio.run(run_phase(frontend.addr, users, output_len))
    after = [g.stats() for g in groups]
    pairs = list(zip(after, before, strict=True))
    return Phase(
        per_user,
        duration,
        [a.prefix_cache_queries - b.prefix_cache_queries for a, b in pairs],
        [a.prefix_cache_hits - b.prefix_cache_hits for a, b in pairs],
    )


def summarize(name: str, phases: list[Phase]) -> dict:
    """The phases of one policy pooled: rates over their summed durations, percentiles over all requests."""
    results = [r for p in phases for user in p.per_user for r in user]
    ok = [r for r in results if not r.error]
    duration = sum(p.duration for p in phases)
    ttfts = [r.ttft * 1000 for r in ok]
    # A user's first request finds no cache under either policy; the later ones show the routing.
    first = [user[0].ttft * 1000 for p in phases for user in p.per_user if not user[0].error]
    later = [r.ttft * 1000 for p in phases for user in p.per_user for r in user[1:] if not r.error]
    queries = sum(sum(p.queries) for p in phases)
    out = {
        "policy": name,
        "requests": len(results),
        "failed": len(results) - len(ok),
        "duration_s": round(duration, 3),
        "prefix_hit_rate": round(sum(sum(p.hits) for p in phases) / queries, 4) if queries else 0.0,
        "requests_per_s": round(len(ok) / duration, 3),
        "total_tokens_per_s": round(sum(r.prompt_tokens + r.output_tokens for r in ok) / duration, 1),
        "ttft_p50_ms": round(percentile(ttfts, 50), 1),
        "ttft_p99_ms": round(percentile(ttfts, 99), 1),
        "first_request_ttft_p50_ms": round(percentile(first, 50), 1),
        "later_requests_ttft_p50_ms": round(percentile(later, 50), 1),
        "later_requests_ttft_p99_ms": round(percentile(later, 99), 1),
        "prompt_tokens_per_group": [sum(p.queries[i] for p in phases) for i in range(len(phases[0].queries))],
    }
    print(json.dumps(out))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=32)
    parser.add_argument("--requests-per-user", dest="rpu", type=int, default=8)
    parser.add_argument("--system-len", type=int, default=384)
    parser.add_argument(
        "--system-prompts", type=int, default=0, help="distinct system prompts, users share them (0: one per user)"
    )
    parser.add_argument("--question-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--kv-cache-memory", default="", help="per group (default: 2/3 of all system prompts)")
    parser.add_argument("--model", default="", help="HF model directory (default: a random Llama written here)")
    parser.add_argument("--threads", type=int, default=1, help="math threads per worker")
    parser.add_argument("--rounds", type=int, default=2, help="phases per policy, in A-B-B-A order")
    parser.add_argument("--routing-args", default="", help="more flags for the cache-aware frontend (--routing-*)")
    args = parser.parse_args()

    from tests.routing.groups import Frontend, Group

    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        model = args.model or write_model(str(tmp / "model"))
        kv = args.kv_cache_memory or kv_bytes(args)
        worker_args = ["--kv-cache-memory", str(kv), "--num-threads", str(args.threads), "--max-model-len", "1024"]
        groups = [Group(f"g{i}", model, tmp, worker_args).start() for i in range(2)]
        addrs = [g.addr for g in groups]
        frontends = {
            "round-robin": Frontend(addrs, tmp / "rr.log", ["--routing-policy", "round-robin"]).start(),
            "cache-aware": Frontend(addrs, tmp / "ca.log", args.routing_args.split()).start(),
        }
        try:
            for part in (*groups, *frontends.values()):
                part.wait_serving()
            time.sleep(1.0)  # every frontend's streams to both groups open
            # Warm-up on prompts of no phase (first-step costs, allocator).
            run_policy(frontends["cache-aware"], groups, workload(0, args)[:2], args.output_len)
            # A-B-B-A...: a drift in the machine's load over the run weighs on both policies alike.
            order = [["round-robin", "cache-aware"], ["cache-aware", "round-robin"]]
            names = [name for r in range(args.rounds) for name in order[r % 2]]
            phases: dict[str, list[Phase]] = {"round-robin": [], "cache-aware": []}
            for seed, name in enumerate(names, start=1):
                phases[name].append(run_policy(frontends[name], groups, workload(seed, args), args.output_len))
            results = [summarize(name, phases[name]) for name in ("round-robin", "cache-aware")]
        finally:
            for part in (*frontends.values(), *groups):
                part.stop()
    rr, ca = results
    ratios = {
        "prefix_hit_rate": f"{ca['prefix_hit_rate']:.3f} vs {rr['prefix_hit_rate']:.3f}",
        "throughput_ratio": round(ca["requests_per_s"] / rr["requests_per_s"], 3),
        "ttft_p50_ratio": round(ca["ttft_p50_ms"] / rr["ttft_p50_ms"], 3),
        "ttft_p99_ratio": round(ca["ttft_p99_ms"] / rr["ttft_p99_ms"], 3),
    }
    print("cache-aware / round-robin:", json.dumps(ratios))
    save("routing_bench", {"args": vars(args), "phases": results, "ratios": ratios})


def write_model(path: str) -> str:
    from tests.worker.tiny import save_tiny_model, save_tiny_tokenizer

    save_tiny_model(path, **MODEL_SHAPE)
    save_tiny_tokenizer(path)
    return path


def kv_bytes(args) -> int:
    """A group's KV cache: two thirds of all system prompts, and never under 8 of them (float32 K and V of
    MODEL_SHAPE)."""
    per_token = 2 * MODEL_SHAPE["num_hidden_layers"] * MODEL_SHAPE["num_key_value_heads"] * MODEL_SHAPE["head_dim"] * 4
    return int(per_token * max(args.system_prompts or args.users, 8) * args.system_len * 2 / 3)


if __name__ == "__main__":
    main()
