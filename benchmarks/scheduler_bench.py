"""Micro-benchmark of the pure scheduler: time per decode step with many running requests.

    python -m benchmarks.scheduler_bench [--requests 256] [--budget 2048] [--steps 500]

Builds the scheduler from plain numbers (no gRPC, no worker), admits the requests,
runs their prefills, then times steady-state decode steps: ``schedule`` and
``update_from_output`` (the scheduler's own work per step, the target is < 2 ms),
and separately ``plan_to_proto`` (building the StepPlan message for the wire).
Prints a table and writes JSON to ``benchmarks/results/scheduler_bench.json``.

With ``--service`` it also times the whole step loop of the service (scheduler over
gRPC, a worker that computes nothing, every token streamed to Submit callers in
another process): milliseconds per step and tokens per second, an upper bound on
what the scheduler service adds to each decode step.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import sys
import time

from benchmarks.results import save
from kvgrid.v1 import worker_pb2, worker_pb2_grpc
from services.common.config import CacheConfig, Config, ModelConfig, NetworkConfig, SchedulerConfig
from services.common.server import bind, new_server
from services.scheduler.block_pool import BlockPool
from services.scheduler.convert import plan_to_proto
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request import Request, StopConditions
from services.scheduler.scheduler import Scheduler, SchedulerLimits
from services.scheduler.server import start

BLOCK_SIZE = 16
PROMPT_LEN = 200
SYSTEM_PROMPT = list(range(1000, 1128))  # shared by every request: 8 full blocks to hit


def build(num_requests: int, budget: int, caching: bool, decode_steps: int) -> Scheduler:
    num_blocks = num_requests * -(-(PROMPT_LEN + decode_steps + 64) // BLOCK_SIZE)
    kv = KVCacheManager(BlockPool(num_blocks, caching), BLOCK_SIZE)
    limits = SchedulerLimits(max_num_seqs=num_requests, max_num_batched_tokens=budget, max_model_len=1 << 20)
    scheduler = Scheduler(limits, kv, eos_token_ids=[2])
    for i in range(num_requests):
        prompt = SYSTEM_PROMPT + [(i * 7 + j) % 30000 for j in range(PROMPT_LEN - len(SYSTEM_PROMPT))]
        scheduler.add_request(Request(f"req-{i}", prompt, StopConditions(max_tokens=1 << 20, ignore_eos=True)))
    return scheduler


def sample_all(out) -> list[tuple[str, int, None]]:
    """What a worker answers: a token for every request that reached the end of its known tokens."""
    sampled = []
    for plans in (out.new_requests, out.running):
        for plan in plans:
            request = plan.request
            if request.num_computed_tokens == request.num_tokens:
                sampled.append((request.request_id, (request.num_tokens * 31) % 30000 + 3, None))
    return sampled


def run(num_requests: int, budget: int, steps: int, caching: bool) -> dict:
    scheduler = build(num_requests, budget, caching, steps)
    while scheduler.num_waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in scheduler.running):
        out = scheduler.schedule()
        scheduler.update_from_output(out, sample_all(out))
    schedule_ms, update_ms, proto_ms, step_ms = [], [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = scheduler.schedule()
        t1 = time.perf_counter()
        plan_to_proto(out)
        t2 = time.perf_counter()
        sampled = sample_all(out)
        t3 = time.perf_counter()
        scheduler.update_from_output(out, sampled)
        t4 = time.perf_counter()
        assert len(out.running) == num_requests and out.total_num_scheduled_tokens == num_requests
        schedule_ms.append((t1 - t0) * 1e3)
        proto_ms.append((t2 - t1) * 1e3)
        update_ms.append((t4 - t3) * 1e3)
        step_ms.append((t1 - t0 + t4 - t3) * 1e3)

    def summary(xs: list[float]) -> dict:
        xs = sorted(xs)
        return {"mean": statistics.fmean(xs), "p50": xs[len(xs) // 2], "p99": xs[int(len(xs) * 0.99)]}

    return {
        "requests": num_requests,
        "budget": budget,
        "steps": steps,
        "prefix_caching": caching,
        "schedule_ms": summary(schedule_ms),
        "update_ms": summary(update_ms),
        "step_ms": summary(step_ms),
        "plan_to_proto_ms": summary(proto_ms),
    }


class NullWorker(worker_pb2_grpc.WorkerServicer):
    """A worker that computes nothing: it tracks how many tokens each request lacks and samples token 5."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks

    async def Handshake(self, request, context):
        return worker_pb2.HandshakeResponse(
            model="bench", block_size=BLOCK_SIZE, num_blocks=self.num_blocks, max_model_len=1 << 20, vocab_size=32000
        )

    async def Execute(self, request_iterator, context):
        lacking: dict[str, int] = {}  # tokens known to the worker but not computed yet
        async for plan in request_iterator:
            for request_id in plan.finished_ids:
                lacking.pop(request_id, None)
            work = [
                (n.request_id, len(n.token_ids) - n.num_computed_tokens, n.num_scheduled_tokens)
                for n in plan.new_requests
            ]
            work += [(r.request_id, lacking[r.request_id], r.num_scheduled_tokens) for r in plan.running]
            result = worker_pb2.StepResult(step_id=plan.step_id)
            for request_id, lack, num_scheduled in work:
                lack -= num_scheduled
                if lack == 0:
                    item = result.sampled.add()
                    item.request_id, item.token_id = request_id, 5
                    lack = 1  # the sampled token
                lacking[request_id] = lack
            yield result


# The Submit callers run in a child process, as the tokenizer frontend does, so only the service is timed here.
CLIENT = """
import asyncio, sys, time
from kvgrid.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.common.server import insecure_channel

async def main(port, num_requests, max_tokens, prompt):
    stub = scheduler_pb2_grpc.SchedulerStub(insecure_channel(f"127.0.0.1:{port}"))
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    async def one(i):
        request = scheduler_pb2.SubmitRequest(request_id=f"req-{i}", prompt_token_ids=prompt + [i], sampling=sampling)
        return sum([len(r.token_ids) async for r in stub.Submit(request)])
    started = time.perf_counter()
    num_tokens = sum(await asyncio.gather(*(one(i) for i in range(num_requests))))
    print(num_tokens, time.perf_counter() - started)

asyncio.run(main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), list(range(1000, 1000 + int(sys.argv[4])))))
"""


async def run_service(num_requests: int, budget: int, max_tokens: int) -> dict:
    num_blocks = num_requests * -(-(PROMPT_LEN + max_tokens + 16) // BLOCK_SIZE)
    worker = new_server()
    worker_pb2_grpc.add_WorkerServicer_to_server(NullWorker(num_blocks), worker)
    worker_port = bind(worker, "127.0.0.1", 0)
    await worker.start()
    config = Config(
        model=ModelConfig(),
        cache=CacheConfig(block_size=BLOCK_SIZE),
        scheduler=SchedulerConfig(max_num_seqs=num_requests, max_num_batched_tokens=budget),
        network=NetworkConfig(host="127.0.0.1", scheduler_port=0, worker_addr=f"127.0.0.1:{worker_port}"),
    )
    server = await start(config)
    while not server.engine.ready:
        await asyncio.sleep(0.01)
    args = [str(server.port), str(num_requests), str(max_tokens), str(PROMPT_LEN - 1)]
    client = await asyncio.create_subprocess_exec(sys.executable, "-c", CLIENT, *args, stdout=asyncio.subprocess.PIPE)
    stdout, _ = await client.communicate()
    num_tokens, seconds = stdout.split()
    num_tokens, seconds = int(num_tokens), float(seconds)
    num_steps = server.engine.stats().num_steps
    await server.stop(0)
    await worker.stop(0)
    assert num_tokens == num_requests * max_tokens
    return {
        "requests": num_requests,
        "budget": budget,
        "max_tokens": max_tokens,
        "steps": num_steps,
        "ms_per_step": seconds / num_steps * 1e3,
        "tokens_per_second": num_tokens / seconds,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--service", action="store_true", help="also time the service's step loop over gRPC")
    parser.add_argument("--max-tokens", type=int, default=200, help="tokens per request in the --service run")
    args = parser.parse_args(argv)
    rows = [run(args.requests, args.budget, args.steps, caching) for caching in (True, False)]
    print(f"scheduler decode step, {args.requests} running requests, budget {args.budget}, {args.steps} steps")
    header = ("prefix cache", "step mean", "p50", "p99", "schedule", "update", "to proto")
    print(" | ".join(f"{h:>12}" for h in header))
    for row in rows:
        cells = [
            "on" if row["prefix_caching"] else "off",
            *(f"{row['step_ms'][k]:.3f} ms" for k in ("mean", "p50", "p99")),
            *(f"{row[k]['mean']:.3f} ms" for k in ("schedule_ms", "update_ms", "plan_to_proto_ms")),
        ]
        print(" | ".join(f"{c:>12}" for c in cells))
    print("target: step mean < 2 ms (schedule + update_from_output)")
    report = {"python": platform.python_version(), "results": rows}
    if args.service:
        service = asyncio.run(run_service(args.requests, args.budget, args.max_tokens))
        print(
            f"service step loop, {args.requests} streams x {args.max_tokens} tokens, null worker: "
            f"{service['ms_per_step']:.2f} ms per step, {service['tokens_per_second']:.0f} tokens/s"
        )
        report["service"] = service
    save("scheduler_bench", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
