"""Run every benchmark in turn (``make bench``); each prints its own table and writes JSON to ``benchmarks/results/``.

Benchmarks are measurements, never tests: nothing here asserts a timing. Each number that the
README quotes is a ratio against a baseline measured in the same run (Hugging Face ``generate``
for the worker, the torch backend for the Triton kernels).
"""

from __future__ import annotations

import os
import subprocess
import sys

BENCHMARKS = [
    ["benchmarks.scheduler_bench"],
    ["benchmarks.control_plane_bench", "--concurrency", "256"],
    ["benchmarks.sampling_bench", "--threads", "2"],
    ["benchmarks.structured_bench", "--threads", "2"],
    ["benchmarks.http_vs_grpc_bench", "--serve"],
    ["benchmarks.worker_bench", "--dtype", "bfloat16"],
    ["benchmarks.worker_bench", "--dtype", "float32"],
    ["benchmarks.offline_bench"],
    ["benchmarks.embed_bench"],
    ["benchmarks.worker_bench", "--dtype", "float32", "--quantization", "gguf"],
    ["benchmarks.quant_bench"],
    ["benchmarks.serving_bench"],
    ["benchmarks.serving_bench", "--quantization", "int8", "--mixed-requests", "0"],
    ["benchmarks.serving_bench", "--quantization", "gguf", "--mixed-requests", "0"],
    ["benchmarks.peer_bench", "--against", "vllm"],
    ["benchmarks.attention_bench"],  # CUDA only; says so and exits 0 elsewhere
]
# Benchmarks that need a peer installed outside kvgrid's venv: run only when its variable names it.
NEEDS = {"benchmarks.peer_bench": "KVGRID_VLLM_PYTHON"}


def main() -> int:
    failed = []
    for argv in BENCHMARKS:
        print(f"\n=== python -m {' '.join(argv)}", flush=True)
        if argv[0] in NEEDS and not os.environ.get(NEEDS[argv[0]]):
            print(f"skipped: set {NEEDS[argv[0]]} (benchmarks/README.md says how to install the peer)", flush=True)
            continue
        if subprocess.run([sys.executable, "-m", *argv]).returncode != 0:
            failed.append(argv[0])
    if failed:
        print(f"\nfailed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
