"""Micro-benchmark of the pure scheduler: time per decode step with many running requests.

    python -m benchmarks.scheduler_bench [--requests 256] [--budget 2048] [--steps 500]

Builds the scheduler from plain numbers (no gRPC, no worker), admits the requests,
runs their prefills, then times steady-state decode steps: ``schedule`` and
``update_from_output`` (the scheduler's own work per step, the target is < 2 ms),
and separately ``plan_to_proto`` (building the StepPlan message for the wire).
Prints a table and writes JSON to ``benchmarks/results/scheduler_bench.json``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import time

from services.scheduler.block_pool import BlockPool
from services.scheduler.convert import plan_to_proto
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request import Request, StopConditions
from services.scheduler.scheduler import Scheduler, SchedulerLimits

RESULTS = pathlib.Path(__file__).parent / "results" / "scheduler_bench.json"
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=500)
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
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"python": platform.python_version(), "results": rows}, indent=2) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
