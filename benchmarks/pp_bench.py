"""Pipeline parallel: decode tokens/s and the fraction of the time each stage computes, at 1 and P stages.

    python -m benchmarks.pp_bench [--stages 2] [--batch-sizes 1,16] [--steps 32] [--micro-batches on,off] [--model DIR]

Each variant is a worker core built as ``kvgrid worker --pipeline-parallel-size P`` builds it (rank 0 in this
process, the other stages' ranks spawned), driven directly (no gRPC) by ``worker_bench``'s decode loop: prefill
untimed, then ``--steps`` timed decode steps of the whole batch, ``--rounds`` times in turns; medians. Each
stage counts the seconds it spends in its layers (``StagedModel.busy_s``); a stage's busy fraction is that
count over the timed wall time. Micro-batches off (``runner.execute``, the way a worker runs a plan that shares
requests with the pipeline): one batch in flight, the stages take turns, each busy about 1/P of the time. On
(``MicroBatchPipeline``, as the worker runs the scheduler's disjoint plans): the batch split into P
micro-batches, rank 0 launching the next through stage 0 while the later stages run the earlier ones, so the
stages overlap; tokens are the same either way. On a CPU the stages share the machine's cores (``--threads``
split between them), so P stages cannot beat one, and overlapping stages compete for those cores; on devices
of their own the busy fractions are what the overlap buys. Without ``--model``: tp_bench's random
SmolLM2-shaped Llama (30 layers) in a temporary directory. Writes ``benchmarks/results/pp_bench_<device>.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections import deque

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from benchmarks.results import save  # noqa: E402
from benchmarks.tp_bench import save_smollm_shaped  # noqa: E402
from benchmarks.worker_bench import decode_requests, kvgrid_decode  # noqa: E402
from services.common.config import build_config  # noqa: E402
from services.worker.core import WorkerCore, build_core  # noqa: E402
from services.worker.parallel.micro_batches import MicroBatchPipeline  # noqa: E402


def core(model: str, args, stages: int) -> WorkerCore:
    environ = {
        "KVGRID_MODEL": model,
        "KVGRID_DTYPE": args.dtype,
        "KVGRID_DEVICE": args.device,
        "KVGRID_KV_CACHE_MEMORY": "512MiB",
        "KVGRID_MAX_MODEL_LEN": "1024",
        "KVGRID_CPU_KERNELS": "torch",
        "KVGRID_PIPELINE_PARALLEL_SIZE": str(stages),
        "KVGRID_NUM_THREADS": str(max(1, args.threads // stages)),
    }
    return build_core(build_config(environ=environ))


def micro_batch_decode(c: WorkerCore, stages: int, batch: int, prompt_len: int, steps: int) -> float:
    """Decode tokens/s with the batch split into ``stages`` micro-batches kept in the pipeline together."""
    runner = c.runner
    requests = decode_requests(batch, prompt_len, steps, c.vocab_size)
    runner.execute(requests)  # prefill and two warm-up decodes, as kvgrid_decode
    for _ in range(2):
        for r in requests:
            r.num_scheduled_tokens = 1
        runner.execute(requests)
    for r in requests:
        r.num_scheduled_tokens = 1
    waiting = deque(group for group in (requests[i::stages] for i in range(stages)) if group)
    pipe = MicroBatchPipeline(runner, stages)
    total, launched = steps * len(waiting), 0
    start = time.perf_counter()
    while launched < total or pipe.pending:
        if launched < total and waiting and not pipe.full:
            pipe.launch(None, waiting.popleft(), 0.0)
            launched += 1
            continue
        step, _ = pipe.complete()
        for r in step.scheduled:
            r.num_scheduled_tokens = 1
        waiting.append(step.scheduled)
    return batch * steps / (time.perf_counter() - start)


def measure(c: WorkerCore, args, batch: int, stages: int, micro: bool) -> dict:
    """tok/s of one decode run and, with stages, each stage's busy fraction over it."""
    vocab = c.vocab_size
    before = c.ranks.stage_busy(c.runner) if c.ranks is not None else []
    started = time.perf_counter()
    if micro:
        tok_s = micro_batch_decode(c, stages, batch, args.prompt_len, args.steps)
    else:
        tok_s = kvgrid_decode(c.runner, batch, args.prompt_len, args.steps, vocab)
    wall = time.perf_counter() - started  # the whole run: prefill and warm-up decodes too, as the busy counts
    after = c.ranks.stage_busy(c.runner) if c.ranks is not None else []
    return {"tok_s": tok_s, "busy": [(b - a) / wall for a, b in zip(before, after, strict=True)]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2, help="CPU threads in all, split between the stages")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument(
        "--micro-batches", default="on,off", help="with P stages: on (P micro-batches in flight), off, or both"
    )
    parser.add_argument("--model", default="", help="HF directory (default: a random SmolLM2-shaped Llama)")
    parser.add_argument("--json", default="", help="where to write the result (default: benchmarks/results/)")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    modes = [m.strip() for m in args.micro_batches.split(",")]
    if not modes or set(modes) - {"on", "off"}:
        parser.error("--micro-batches takes on, off or on,off")
    # name -> (stages, micro-batches on)
    variants = {"pp1": (1, False), **{f"pp{args.stages}-micro-{m}": (args.stages, m == "on") for m in modes}}
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or save_smollm_shaped(tmp)
        cores = {1: core(model, args, 1), args.stages: core(model, args, args.stages)}
        runs: dict[str, dict[int, list[dict]]] = {name: {b: [] for b in batches} for name in variants}
        for _ in range(args.rounds):
            for batch in batches:
                for name, (stages, micro) in variants.items():
                    torch.set_num_threads(max(1, args.threads // stages))
                    runs[name][batch].append(measure(cores[stages], args, batch, stages, micro))
        for c in cores.values():
            if c.ranks is not None:
                c.ranks.stop()
    result = {
        name: {
            b: {
                "tok_s": statistics.median(r["tok_s"] for r in rs),
                "stage_busy": [statistics.median(r["busy"][s] for r in rs) for s in range(len(rs[0]["busy"]))],
            }
            for b, rs in per.items()
        }
        for name, per in runs.items()
    }
    print("| variant | micro-batches | " + " | ".join(f"batch {b}: tok/s, stage busy" for b in batches) + " |")
    print(f"|---|---|{'---|' * len(batches)}")
    for name, per in result.items():
        cells = [
            f"{per[b]['tok_s']:.1f}, " + (" / ".join(f"{x:.0%}" for x in per[b]["stage_busy"]) or "-") for b in batches
        ]
        micro = "on" if variants[name][1] else "off"
        print(f"| {name} | {micro} | {' | '.join(cells)} |")
    save(f"pp_bench_{args.device}", {"args": vars(args), "result": result}, args.json or None)


if __name__ == "__main__":
    main()
