"""How `kvgrid serve` keeps its children: start each in its own session, restart one that dies (with backoff, up to a
limit), and stop them stage by stage.

A stage is one service: the worker, the scheduler, or the frontends (one process, or ``--api-server-count`` of them
sharing the public ports). Stopping goes through the stages in reverse start order; the processes of one stage are
told at once and waited for together, so N frontends drain side by side within one --shutdown-grace.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvgrid.cli.probes import is_serving

# Beyond its --shutdown-grace, how long a stopping child may take to close before it is killed.
STOP_MARGIN_SECONDS = 10.0

# Restarts: exponential backoff, and a limit on crashes in a window.
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
# More crashes than this within the window stop the stack: a child that keeps dying needs a person.
MAX_CRASHES = 5
WINDOW_S = 120.0


def say(text: str) -> None:
    print(f"kvgrid serve: {text}", flush=True)


@dataclass(slots=True)
class RestartPolicy:
    first_backoff: float = FIRST_BACKOFF_S
    max_backoff: float = MAX_BACKOFF_S
    max_crashes: int = MAX_CRASHES
    window: float = WINDOW_S
    _crashes: deque[float] = field(default_factory=deque)

    def crashed(self, now: float) -> float | None:
        """Record a crash at ``now``; the seconds to wait before restarting, or None when it crashed too often."""
        self._crashes.append(now)
        while self._crashes and now - self._crashes[0] > self.window:
            self._crashes.popleft()
        if len(self._crashes) > self.max_crashes:
            return None
        return min(self.first_backoff * 2 ** (len(self._crashes) - 1), self.max_backoff)

    @property
    def num_recent(self) -> int:
        return len(self._crashes)


@dataclass(slots=True)
class Child:
    name: str  # as the log names it: the service, or "tokenizer-2" for one of several frontends
    argv: list[str]
    grpc_addr: str
    process: subprocess.Popen | None = None
    restarts: RestartPolicy = field(default_factory=RestartPolicy)
    # When a crashed child is due to start again (monotonic seconds); None while it runs.
    restart_at: float | None = None
    env: dict[str, str] | None = None  # added to serve's own environment
    # Whether the child reports SERVING (default: the plaintext gRPC health check of grpc_addr).
    probe: Callable[[], bool] | None = None
    stage: str = ""  # the service; children of one stage stop together (default: the name)

    def __post_init__(self) -> None:
        self.stage = self.stage or self.name


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM if serve itself dies (Linux), so no service is orphaned."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def start(child: Child) -> None:
    # A new session: a terminal's Ctrl-C reaches serve only, which then stops the children in order.
    env = {**os.environ, **child.env} if child.env else None
    child.process = subprocess.Popen(child.argv, start_new_session=True, preexec_fn=_die_with_parent, env=env)


def child_serving(child: Child) -> bool:
    return child.probe() if child.probe is not None else is_serving(child.grpc_addr)


def first_exited(children: list[Child]) -> Child | None:
    return next((c for c in children if c.process and c.process.poll() is not None), None)


def stages(children: list[Child]) -> list[list[Child]]:
    """The children grouped by stage, in start order."""
    grouped: dict[str, list[Child]] = {}
    for child in children:
        grouped.setdefault(child.stage, []).append(child)
    return list(grouped.values())


def stop_all(children: list[Child], grace: float = 0.0) -> None:
    """Stop the stages one at a time in reverse start order (frontends, scheduler, worker): SIGTERM to every
    process of the stage, then up to ``grace`` (their --shutdown-grace) plus a margin for them to exit before
    SIGKILL. The frontends finish their streams before the scheduler is told to stop, and the scheduler its
    requests before the worker is."""
    timeout = grace + STOP_MARGIN_SECONDS
    for stage in reversed(stages(children)):
        running = [c for c in stage if c.process and c.process.poll() is None]
        for child in running:
            say(f"stopping the {child.name} (pid {child.process.pid})")
            child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for child in running:
            try:
                child.process.wait(timeout=max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                say(f"the {child.name} did not stop within {timeout:g}s; killing it")
                child.process.kill()
                child.process.wait()


def describe_exit(child: Child) -> str:
    code = child.process.returncode
    how = f"was killed by signal {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    return f"the {child.name} {how}"


def restart_crashed(children: list[Child], now: float) -> bool:
    """Schedule a restart for each child that died, start those that are due; False when one crashed too often."""
    for child in children:
        if child.restart_at is None and child.process.poll() is not None:
            delay = child.restarts.crashed(now)
            if delay is None:
                policy = child.restarts
                say(
                    f"{describe_exit(child)}: {policy.num_recent} exits within {policy.window:g}s, "
                    "so it is not restarted again; stopping the stack (see its log above)"
                )
                return False
            say(f"{describe_exit(child)}; restarting it in {delay:g}s (see its log above)")
            child.restart_at = now + delay
        elif child.restart_at is not None and now >= child.restart_at:
            child.restart_at = None
            start(child)
            say(f"restarted the {child.name} (pid {child.process.pid})")
    return True


class Signals:
    """SIGINT/SIGTERM set a flag; the supervision loop polls it."""

    def __init__(self):
        self.received = threading.Event()
        self.name = ""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame) -> None:
        self.name = signal.Signals(signum).name
        self.received.set()
