"""How `kvgrid serve` arranges the worker's OpenMP thread team next to the frontend and scheduler.

On a small machine the three services share the cores: the worker's team (one thread per core,
measured faster than leaving a core free: a 1-thread worker gave 25.7 tok/s against 37.1 at batch
1 on 2 cores) loses a core whenever the frontend or scheduler wakes. Two things keep that from
stalling a step. The native kernels hand work out dynamically (a thread that loses its core
delays only the chunk it holds). And the team's idle threads spin long enough
(``GOMP_SPINCOUNT``) to catch the next parallel region of the step: a step's regions are separated
by Python glue (a ctypes call, a torch dispatch), and a thread that went to sleep in such a gap
costs a wake-up at the next region. Under async scheduling steps run back to back, so there is
no idle time between them to hand over. Measured on 2 cores in paired runs of
``benchmarks.serving_bench``: 300,000 iterations against 20,000 gave the stack 698-707 against
665 tok/s at 64 int8 requests (0.94-0.97 of the worker alone, against 0.88), and the same at
batch 1 (gguf, float32). A user's own OpenMP settings win.
"""

from __future__ import annotations

from collections.abc import Mapping

SPIN = "300000"  # libgomp spin iterations (its own default), stated so that the measured value holds
OPENMP_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def worker_arrangement(num_threads: int, num_cores: int, environ: Mapping[str, str]) -> tuple[dict[str, str], str]:
    """(variables to add to the worker's environment, one line for the log)."""
    threads = num_threads or num_cores
    own = [f"{name}={environ[name]}" for name in OPENMP_VARIABLES if name in environ]
    if own:
        return {}, f"worker: {threads} threads, OpenMP waits as set ({', '.join(own)})"
    if threads + 2 <= num_cores:
        return {}, f"worker: {threads} threads on {num_cores} cores, cores to spare for frontend and scheduler"
    return (
        {"GOMP_SPINCOUNT": SPIN},
        f"worker: {threads} threads sharing {num_cores} cores with frontend and scheduler;"
        f" idle threads spin through a step's gaps, then sleep (GOMP_SPINCOUNT={SPIN})",
    )
