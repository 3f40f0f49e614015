"""How many threads the worker's math runs on (torch's intra-op team, which the native kernels take too)."""

from __future__ import annotations

import logging

import torch

from services.common.cpu_quota import cpu_quota_cores, default_threads

log = logging.getLogger(__name__)


def set_math_threads(asked: int) -> int:
    """Sets torch's (and so the native kernels') threads: ``asked``, or where that is 0 torch's own count capped by
    the cgroup's quota (logged when it caps). Returns the count."""
    threads = asked
    if not threads:
        team, quota = torch.get_num_threads(), cpu_quota_cores()
        threads = default_threads(team, quota)
        if threads < team:
            log.info("%d CPU threads for the math: the cgroup's CPU quota is %.2f cores (of %d)", threads, quota, team)
    torch.set_num_threads(threads)
    return threads
