"""`kvgrid serve` for the fault tests, and what its log says about its children."""

from __future__ import annotations

import os
import re
import signal
import time

from tests.e2e.stack import Stack, pid_alive
from tests.faults.services import MODEL_ARGS, wait_serving

GRACE_S = 120


def serve_stack(log_path) -> Stack:
    return Stack(log_path, [*MODEL_ARGS, "--shutdown-grace", str(GRACE_S)])


def child_pid(stack: Stack, name: str) -> int:
    """The pid of the child's current process: from its last restart line, else from the ready line."""
    restarts = re.findall(rf"kvgrid serve: restarted the {name} \(pid (\d+)\)", stack.log())
    return int(restarts[-1]) if restarts else stack.child_pids[name]


def kill_child(stack: Stack, name: str, timeout: float = 240) -> int:
    """kill -9 the child, then wait until serve restarted it and the public API serves again; the new pid."""
    old = child_pid(stack, name)
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while child_pid(stack, name) == old or pid_alive(old):
        if time.monotonic() > deadline:
            raise TimeoutError(f"serve did not restart the {name}:\n{stack.log()[-4000:]}")
        time.sleep(0.1)
    wait_serving(stack.addr, "the frontend", timeout)
    return child_pid(stack, name)
