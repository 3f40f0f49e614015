"""A worker group: ``--tensor-parallel-size T`` x ``--pipeline-parallel-size P`` ranks, rank 0 the gRPC worker.

Rank 0 serves the rendezvous store (``rendezvous.py``) with the rank plan in it, opens the control channel
(``control.py``), and starts the ranks of its own node (1..R-1 of R = world / --nnodes) as child processes;
the ranks of nodes 1..N-1 are started there by ``kvgrid worker-rank`` (``node.py``). Every rank loads its
stage's layers and its share of their weights, sizes its own KV cache, and all take the block count of the
smallest (the handshake reports it). Rank 0 then prepares each step as usual and sends the step's flat batch
(token ids, positions, attention metadata) to every rank before running it; the ranks of a stage meet at
the all-reduces, stages pass hidden states on, and only rank 0 computes logits and samples. Sampled tokens
never leave rank 0: its next step's batch carries them.

A rank that dies takes the worker down: rank 0 sees its control connection close (or its local process
exit), stops the local ranks and ends its own process (the scheduler sees UNAVAILABLE and re-dials). Ranks
die with rank 0 (the control channel's end-of-file; local ones also by PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
from collections.abc import Callable

import torch

from services.common.config import Config
from services.worker.model_runner import ModelRunner, StepInputs
from services.worker.parallel import rendezvous
from services.worker.parallel.control import ControlServer
from services.worker.parallel.follower import follower_main, pack_step
from services.worker.parallel.group import DistGroup, RankLost
from services.worker.parallel.plan import (
    RankPlan,
    check_options,
    layout_of,
    pipeline_parallel_size,
    rank_device,
    ranks_per_node,
    tensor_parallel_size,
    world_size,
)
from services.worker.parallel.sharding import check_size
from services.worker.parallel.stages import BusyQuery, check_stages, layer_ranges
from services.worker.setup.gguf_cache import cached_source
from services.worker.setup.loader import ModelLoadError, read_config, resolve_source
from services.worker.setup.memory import cpu_kv_cache_bytes, read_meminfo

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0
LOCAL_HOST = "127.0.0.1"


def start_ranks(config: Config, model_path: str) -> tuple[Ranks, str]:
    """Checks that the model splits into the group's shards and stages, then starts this node's other ranks.

    Returns the handle and the model path every rank loads (a GGUF file's converted cache, made once here)."""
    size, tp, pp = world_size(config), tensor_parallel_size(config), pipeline_parallel_size(config)
    check_options(config, tp)
    source = cached_source(resolve_source(model_path, config.load.load_format))
    hf_config, args = read_config(source)
    try:
        if tp > 1:
            check_size(args, tp)
        if pp > 1:
            check_stages(hf_config.model_type, args, pp)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc
    cuda = rank_device(config, 0).type == "cuda"
    share = 0 if cuda else cpu_kv_cache_bytes(config.cache.kv_cache_memory, read_meminfo()[1]) // size
    threads, local = config.device.num_threads, ranks_per_node(config)
    if not cuda and threads == 0:  # the ranks share this machine's cores rather than each taking all of them
        threads = max(1, torch.get_num_threads() // local)
        torch.set_num_threads(threads)
        log.info("worker group on CPU: %d threads per rank", threads)
    multi_node = config.parallel.nnodes > 1
    host, port = rendezvous.init_address(config) or (LOCAL_HOST, 0)
    store = rendezvous.serve_store(host, port, size)
    control = ControlServer("" if multi_node else LOCAL_HOST, size - 1)
    layers = layer_ranges(args.num_layers, pp) if pp > 1 else None
    plan = RankPlan(config, source.path, size, f"{host}:{store.port}", share, threads, os.getpid(), layers)
    rendezvous.publish(store, plan, control.port)
    if multi_node:
        log.info(
            "rendezvous tcp://%s:%d: start nodes 1..%d with kvgrid worker-rank",
            host,
            store.port,
            config.parallel.nnodes - 1,
        )
    return Ranks(plan, store, control, local), source.path


class Ranks:
    """Rank 0's handle on the other ranks: starts its node's, feeds all of them steps, watches them, stops them."""

    def __init__(self, plan: RankPlan, store, control: ControlServer, num_local: int):
        self.plan, self.store, self.control = plan, store, control
        self.size = plan.size
        self.group: DistGroup | None = None
        self.stopping = False
        self.busy_queries = 0
        self._lost_once = threading.Lock()
        # Called (on a watch thread) when a rank exits unasked; by default this process exits.
        self.on_lost: Callable[[str], None] = exit_now
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked CUDA or OpenMP state
        self.procs: dict[int, multiprocessing.process.BaseProcess] = {}
        for rank in range(1, num_local):
            proc = ctx.Process(
                target=follower_main, args=(plan, rank, LOCAL_HOST), name=f"kvgrid-rank{rank}", daemon=True
            )
            proc.start()
            self.procs[rank] = proc
        kind = "NCCL" if plan.cuda else "gloo"
        c = plan.config.parallel
        log.info(
            "worker group: %d ranks (tensor parallel %d x pipeline parallel %d, %s, %d nodes); rank pids %s",
            plan.size,
            c.tensor_parallel_size,
            c.pipeline_parallel_size,
            kind,
            c.nnodes,
            ", ".join(f"{rank} pid {p.pid}" for rank, p in self.procs.items()) or "none here",
        )
        if plan.layers:
            log.info("pipeline stages' layers: %s", ", ".join(f"[{a}, {b})" for a, b in plan.layers))
        control.on_lost = self._control_lost
        threading.Thread(target=self._watch, name="kvgrid-ranks-watch", daemon=True).start()

    @property
    def alive(self) -> bool:
        """Every local rank still runs (a dead one brings this process down within moments)."""
        return all(p.is_alive() for p in self.procs.values())

    def join_group(self) -> DistGroup:
        """Rank 0's place in the process group (blocks until every rank has joined)."""
        self.group = DistGroup(layout_of(self.plan.config, 0), self.store, rank_device(self.plan.config, 0))
        return self.group

    def drive(self, runner: ModelRunner) -> None:
        """From now on each step the runner computes is sent to every rank first."""
        runner.step_listener = self.send

    def send(self, inputs: StepInputs) -> None:
        try:
            self.control.send(pack_step(inputs))
        except ConnectionError as exc:
            raise RankLost(f"a rank of the worker group is gone ({exc})") from exc

    def stage_busy(self, runner: ModelRunner) -> list[float]:
        """Seconds each pipeline stage has spent computing so far (its first rank's count); between steps only."""
        self.busy_queries += 1
        key = f"kvgrid/busy/{self.busy_queries}"
        self.control.send(BusyQuery(key))
        tp = self.plan.config.parallel.tensor_parallel_size
        others = [float(self.store.get(f"{key}/{stage * tp}")) for stage in range(1, len(self.plan.layers or [0]))]
        return [runner.model.busy_s, *others]

    def stop(self) -> None:
        """Tell every rank to exit and wait for the local ones (killing one that does not in STOP_TIMEOUT_S)."""
        self.stopping = True
        try:
            self.control.send(None)
        except ConnectionError:
            pass
        for proc in self.procs.values():
            proc.join(STOP_TIMEOUT_S)
            if proc.is_alive():
                log.warning("rank pid %d did not stop; killing it", proc.pid)
                proc.kill()
                proc.join()
        self.control.close()
        if self.group is not None:
            self.group.close()

    def kill(self) -> None:
        """Rank 0 failed to start: end the local ranks at once (they may be waiting in a collective for it)."""
        self.stopping = True
        for proc in self.procs.values():
            proc.kill()
            proc.join()
        self.control.close()
        if self.group is not None:
            self.group.close()

    def _watch(self) -> None:
        """Local ranks: a process that exits (also before it reached the control channel)."""
        if not self.procs:
            return
        sentinels = {p.sentinel: rank for rank, p in self.procs.items()}
        rank = sentinels[multiprocessing.connection.wait(list(sentinels))[0]]
        self.procs[rank].join(STOP_TIMEOUT_S / 2)  # its exit code, for the log
        self._lost(rank)

    def _control_lost(self, rank: int) -> None:
        proc = self.procs.get(rank)
        if proc is not None and multiprocessing.connection.wait([proc.sentinel], STOP_TIMEOUT_S / 2):
            return  # a local rank that exited: _watch reports it with its exit code (one thread reaps it)
        self._lost(rank)

    def _lost(self, rank: int) -> None:
        if self.stopping or not self._lost_once.acquire(blocking=False):
            return
        proc = self.procs.get(rank)
        if proc is not None and proc.exitcode is not None:
            reason = f"worker-group rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"
        else:
            reason = f"worker-group rank {rank} closed its control channel (its process or node is gone)"
        log.error("%s: the worker goes down with it", reason)
        for other in self.procs.values():
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
