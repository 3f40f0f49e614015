"""The CPU time a container may use (Kubernetes' ``resources.limits.cpu``, ``docker run --cpus``), in cores.

torch and OpenMP size their thread teams by the cores a process may run on, not by its cgroup's CFS quota: a
pod limited to 4 CPUs on a 64-core node starts a team of 32 or 64 threads, which spend most of each 100 ms
period throttled, and every parallel region waits at its barrier for whichever thread is throttled. So where
``--num-threads`` is 0 the worker takes no more threads than whole cores of quota (``default_threads``; the
worker's ``setup.threads`` sets them), and ``kvgrid serve`` counts the cores it arranges by the same limit
(``usable_cores``, which also sizes the Redis tier's copy threads).

The quota is the smallest on the way from the process's cgroup up to the hierarchy's root (a parent's limit
holds for its children), read from cgroup v2's ``cpu.max`` or v1's ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``.
Inside a container the hierarchy's root is usually the container's own cgroup; a path from ``/proc/self/cgroup``
that does not exist under the mount (no cgroup namespace) is walked up to the first directory that does.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
SELF_CGROUP = Path("/proc/self/cgroup")
V1_CPU_MOUNTS = ("cpu", "cpu,cpuacct", "cpuacct,cpu")


def _ancestors(root: Path, path: str) -> list[Path]:
    """root/path and each directory above it up to root, deepest first, those that exist."""
    parts = [p for p in path.strip("/").split("/") if p and p not in (".", "..")]
    dirs = [root.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]
    return [d for d in dirs if d.is_dir()]


def _v2_limit(directory: Path) -> float | None:
    try:
        quota, period = (directory / "cpu.max").read_text().split()[:2]
        return None if quota == "max" or int(period) <= 0 else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _v1_limit(directory: Path) -> float | None:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def cpu_quota_cores(root: Path = CGROUP_ROOT, self_cgroup: Path = SELF_CGROUP) -> float | None:
    """Cores' worth of CPU time this process's cgroups allow (1.5: 150 ms a 100 ms period), or None: no limit,
    or no cgroup filesystem to read it from."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits: list[float] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # v2: one unified hierarchy
            limits += [q for d in _ancestors(root, path) if (q := _v2_limit(d)) is not None]
        elif "cpu" in controllers.split(","):  # v1: the hierarchy the cpu controller is mounted on
            for mount in V1_CPU_MOUNTS:
                limits += [q for d in _ancestors(root / mount, path) if (q := _v1_limit(d)) is not None]
    return min(limits, default=None)


def default_threads(team: int, quota: float | None) -> int:
    """Threads for the worker's math when none are asked for: torch's own count (``team``), no more than whole cores
    of quota, at least one."""
    if quota is None:
        return team
    return max(1, min(team, math.floor(quota)))


def usable_cores() -> int:
    """The cores this process may run on, no more than whole cores of its cgroup's CPU quota."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return default_threads(cores, cpu_quota_cores())
