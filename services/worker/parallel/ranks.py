"""``--tensor-parallel-size N``: rank 0 (the gRPC worker) starts ranks 1..N-1, one process per device.

Every rank loads its share of the weights, profiles or sizes its own KV cache, and all take the
block count of the smallest (the handshake reports it). Rank 0 then prepares each step as usual
and sends the step's flat batch (token ids, positions, attention metadata) down one pipe per rank
before running it; every rank runs the same forward, meeting at the all-reduces, and only rank 0
computes logits and samples. Sampled tokens never leave rank 0: its next step's batch carries them.

A rank that dies takes the worker down: rank 0 watches its ranks' processes and, when one exits
unasked, stops the others and ends its own process (the scheduler sees UNAVAILABLE and re-dials).
Ranks die with rank 0 (PR_SET_PDEATHSIG, and the pipe's end-of-file).
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import socket
import threading
from collections.abc import Callable

import torch

from services.common.config import Config
from services.worker.model_runner import ModelRunner, StepInputs
from services.worker.parallel.follower import follower_main, pack_step
from services.worker.parallel.group import DistGroup, RankLost
from services.worker.parallel.plan import RankPlan, check_options, rank_device, tensor_parallel_size
from services.worker.parallel.sharding import check_size
from services.worker.setup.gguf_cache import cached_source
from services.worker.setup.loader import ModelLoadError, read_config, resolve_source
from services.worker.setup.memory import cpu_kv_cache_bytes, read_meminfo

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0


def start_ranks(config: Config, model_path: str) -> tuple[Ranks, str]:
    """Checks that the model splits ``--tensor-parallel-size`` ways, then starts ranks 1..N-1.

    Returns the handle and the model path every rank loads (a GGUF file's converted cache, made once here)."""
    size = tensor_parallel_size(config)
    check_options(config, size)
    source = cached_source(resolve_source(model_path, config.load.load_format))
    _, args = read_config(source)
    try:
        check_size(args, size)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc
    cuda = rank_device(config, 0, size).type == "cuda"
    share = 0 if cuda else cpu_kv_cache_bytes(config.cache.kv_cache_memory, read_meminfo()[1]) // size
    threads = config.device.num_threads
    if not cuda and threads == 0:  # the ranks share this machine's cores rather than each taking all of them
        threads = max(1, torch.get_num_threads() // size)
        torch.set_num_threads(threads)
        log.info("tensor parallel on CPU: %d threads per rank", threads)
    plan = RankPlan(config, source.path, size, f"127.0.0.1:{free_port()}", share, threads, os.getpid())
    return Ranks(plan), source.path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Ranks:
    """Rank 0's handle on ranks 1..N-1: starts them, feeds them steps, watches them, stops them."""

    def __init__(self, plan: RankPlan):
        self.plan = plan
        self.size = plan.size
        self.group: DistGroup | None = None
        self.stopping = False
        # Called (on the watch thread) when a rank exits unasked; by default this process exits.
        self.on_lost: Callable[[str], None] = exit_now
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked CUDA or OpenMP state
        self.conns: list[multiprocessing.connection.Connection] = []
        self.procs: list[multiprocessing.process.BaseProcess] = []
        for rank in range(1, plan.size):
            ours, theirs = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=follower_main, args=(plan, rank, ours), name=f"kvgrid-tp-rank{rank}", daemon=True)
            proc.start()
            ours.close()
            self.conns.append(theirs)
            self.procs.append(proc)
        log.info(
            "tensor parallel: %d ranks (%s); rank pids %s",
            plan.size,
            "NCCL" if plan.cuda else "gloo",
            ", ".join(f"{rank} pid {p.pid}" for rank, p in enumerate(self.procs, start=1)),
        )
        threading.Thread(target=self._watch, name="kvgrid-tp-watch", daemon=True).start()

    @property
    def alive(self) -> bool:
        """Every rank still runs (a dead one brings this process down within moments)."""
        return all(p.is_alive() for p in self.procs)

    def join_group(self) -> DistGroup:
        """Rank 0's place in the process group (blocks until every rank has joined)."""
        self.group = DistGroup(0, self.size, self.plan.init_addr, rank_device(self.plan.config, 0, self.size))
        return self.group

    def drive(self, runner: ModelRunner) -> None:
        """From now on each step the runner computes is sent to every rank first."""
        runner.step_listener = self.send

    def send(self, inputs: StepInputs) -> None:
        message = pack_step(inputs)
        for conn in self.conns:
            try:
                conn.send(message)
            except OSError as exc:  # the rank's end is closed: it died
                raise RankLost(f"a tensor-parallel rank is gone ({exc})") from exc

    def stop(self) -> None:
        """Tell every rank to exit and wait for it (killing one that does not in STOP_TIMEOUT_S)."""
        self.stopping = True
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self.procs:
            proc.join(STOP_TIMEOUT_S)
            if proc.is_alive():
                log.warning("tensor-parallel rank pid %d did not stop; killing it", proc.pid)
                proc.kill()
                proc.join()
        if self.group is not None:
            self.group.close()

    def kill(self) -> None:
        """Rank 0 failed to start: end the ranks at once (they may be waiting in a collective for it)."""
        self.stopping = True
        for proc in self.procs:
            proc.kill()
            proc.join()
        if self.group is not None:
            self.group.close()

    def _watch(self) -> None:
        sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(self.procs, start=1)}
        ready = multiprocessing.connection.wait(list(sentinels))
        if self.stopping:
            return
        rank, proc = sentinels[ready[0]]
        proc.join()
        reason = f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"
        log.error("%s: the worker goes down with it", reason)
        for other in self.procs:
            if other.is_alive():
                other.kill()
        # Whatever the callback does (stop the gRPC server), the process ends: rank 0 may be blocked in
        # a collective with the dead rank, which on NCCL never returns.
        threading.Timer(STOP_TIMEOUT_S, exit_now, args=(reason,)).start()
        self.on_lost(reason)


def exit_now(reason: str) -> None:
    """End this process at once (its model thread may be blocked in a collective that never returns)."""
    logging.shutdown()
    os._exit(1)
