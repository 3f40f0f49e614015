"""How `kvgrid serve` arranges the worker's OpenMP thread team next to the frontend and scheduler.

On a small machine the three services share the cores: the worker's team (one thread per core,
measured faster than leaving a core free: a 1-thread worker gave 25.7 tok/s against 37.1 at batch
1 on 2 cores) loses a core whenever the frontend or scheduler wakes. Two things keep that from
stalling a step. The native kernels hand work out dynamically (a thread that loses its core
delays only the chunk it holds). And the team's idle threads spin only briefly
(``GOMP_SPINCOUNT``) before sleeping: inside a step the parallel regions come back to back,
microseconds apart, so a short spin catches them all, while between steps, when the scheduler
and frontend run, a sleeping team leaves them the cores instead of spinning on them
(libgomp's default spins up to 300,000 iterations). A user's own OpenMP settings win.
"""

from __future__ import annotations

from collections.abc import Mapping

SHORT_SPIN = "20000"  # libgomp spin iterations, tens of microseconds: longer than a gap inside a step
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
        {"GOMP_SPINCOUNT": SHORT_SPIN},
        f"worker: {threads} threads sharing {num_cores} cores with frontend and scheduler;"
        f" idle threads spin briefly, then sleep (GOMP_SPINCOUNT={SHORT_SPIN})",
    )
