"""Quantized linears against float32, one matrix at a time, all sides measured in turns in one run.

    python -m benchmarks.quant_bench [--rows 1,8,32,128,512] [--threads 2] [--rounds 3]
        [--paths avx512-vnni,avx2,scalar]

For SmolLM2-135M's matrix shapes (gate/up 3072x576, down 576x1536, the 49152x576 logits), Gemma 3
270M's down projection (640x2048) and each row count: the native quantized kernel (``quant_kernels.c``)
on int8, q8_0, q4_0 and q4_1 weights, and on the K-quants q4_k and q6_k where K is whole 256-value
super-blocks (random blocks: the time does not depend on the values),
the same weights dequantized per call then torch's float32 GEMM (what ``quant.matmul`` does from
``DEQUANTIZE_ROWS`` rows), and torch's float32 GEMM on float weights (the unquantized baseline).
``--paths`` measures the native kernel on each of its dot-product paths (default: the fastest this
CPU has). Prints microseconds per product (medians) and speed-ups over float32; JSON to
``benchmarks/results/quant_bench.json``. With ``--threads 1`` times are the thread's CPU time, so
that other processes on a shared machine do not count.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks.results import save
from services.worker.cpu_kernels.library import QUANT_PATHS, select_quant_path
from services.worker.quant import formats, kquants
from services.worker.quant.matmul import dequantize_rows, linear_into

SHAPES = {"gate_up": (3072, 576), "down": (576, 1536), "logits": (49152, 576), "gemma_down": (640, 2048)}


def ggml_pack(fmt: str, weight: torch.Tensor) -> formats.PackedWeight:
    import gguf

    kind = gguf.GGMLQuantizationType[fmt.upper()]
    raw = gguf.quants.quantize(weight.numpy(), kind)
    return formats.PackedWeight(fmt, torch.from_numpy(raw.copy()).view(weight.shape[0], -1), weight.shape[1])


def kquant_blocks(fmt: str, n: int, k: int) -> formats.PackedWeight:
    """Random K-quant super-blocks with small fp16 scales (``gguf`` has no K-quant quantizer)."""
    blocks = torch.randint(0, 256, (n, k // kquants.SUPER, kquants.K_BLOCK_BYTES[fmt]), dtype=torch.uint8)
    scales = torch.full((n, k // kquants.SUPER, 1), 0.01, dtype=torch.float16).view(torch.uint8)
    for at in [208] if fmt == "q6_k" else [0, 2]:
        blocks[..., at : at + 2] = scales
    return formats.PackedWeight(fmt, blocks.view(n, -1), k)


def timed(fn, repeat: int, clock=time.perf_counter) -> float:
    fn()
    start = clock()
    for _ in range(repeat):
        fn()
    return (clock() - start) / repeat * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,32,128,512")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--paths", default=QUANT_PATHS[-1], help=f"native paths, of {','.join(QUANT_PATHS)}")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    paths = [p for p in args.paths.split(",") if select_quant_path(p) == p]  # those this CPU runs
    select_quant_path(QUANT_PATHS[-1])
    samples: dict[tuple[str, int, str], list[float]] = {}
    rows_list = [int(r) for r in args.rows.split(",")]
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        weight = torch.randn(n, k) * 0.05
        packed = {"int8": formats.quantize_int8(weight), "q8_0": ggml_pack("q8_0", weight)}
        packed |= {fmt: ggml_pack(fmt, weight) for fmt in ("q4_0", "q4_1")}
        if k % kquants.SUPER == 0:
            packed |= {fmt: kquant_blocks(fmt, n, k) for fmt in ("q4_k", "q6_k")}
        packed = {fmt: formats.tile(p) for fmt, p in packed.items()}  # as models hold them
        for _ in range(args.rounds):
            for rows in rows_list:
                x = torch.randn(rows, k)
                out = torch.empty(rows, n)
                repeat = max(2, min(50, 2000 // rows))
                sides = {"float32": (None, lambda x=x, w=weight: F.linear(x, w))}
                for fmt, p in packed.items():
                    for path in paths:
                        side = fmt if len(paths) == 1 else f"{fmt} {path}"
                        sides[side] = (path, lambda p=p, x=x, out=out: linear_into(x, p, None, out))
                q41 = packed["q4_1"]
                sides["q4_1 dequantized+GEMM"] = (None, lambda x=x, p=q41: F.linear(x, dequantize_rows(p)))
                for side, (path, fn) in sides.items():
                    select_quant_path(path or QUANT_PATHS[-1])
                    samples.setdefault((name, rows, side), []).append(timed(fn, repeat, clock))
    results = []
    sides = list(dict.fromkeys(side for _, _, side in samples))
    print(f"\nmicroseconds per product, median of {args.rounds} rounds, {args.threads} threads (speed-up vs float32)\n")
    print("| matrix | rows | " + " | ".join(sides) + " |")
    print("|---|---:|" + "---:|" * len(sides))
    for name in args.shapes.split(","):
        for rows in rows_list:
            med = {s: statistics.median(samples[(name, rows, s)]) for s in sides if (name, rows, s) in samples}
            base = med["float32"]
            cells = [
                "-" if s not in med else f"{med[s]:.0f}" + ("" if s == "float32" else f" ({base / med[s]:.2f}x)")
                for s in sides
            ]
            print(f"| {name} {SHAPES[name]} | {rows} | " + " | ".join(cells) + " |")
            results.append({"matrix": name, "shape": SHAPES[name], "rows": rows, "us": med})
    save("quant_bench", {"threads": args.threads, "rounds": args.rounds, "paths": paths, "results": results})


if __name__ == "__main__":
    main()
