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
import signal
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.common.config import Config
from services.common.logs import setup_logging

from ..attention.base import AttentionMetadata
from ..engine import LoadedModel, create_runner, load_model, max_model_len, plan_memory
from ..gguf_cache import cached_source
from ..loader import ModelLoadError, read_config, resolve_source
from ..memory import InsufficientMemory, MemoryFigures, cpu_kv_cache_bytes, read_meminfo
from ..model_runner import ModelRunner, StepInputs
from .group import DistGroup, RankLost
from .sharding import attach_all_reduce, check_size

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0


@dataclass(slots=True)
class RankPlan:
    """What every rank is told at start (picklable: it crosses to the spawned processes)."""

    config: Config
    model_path: str  # resolved: the embedded default model's file, or what --model names
    size: int
    init_addr: str  # host:port of the process group's rendezvous
    kv_cache_memory: int  # CPU: each rank's share of the cache budget (0 on CUDA)
    parent_pid: int

    @property
    def cuda(self) -> bool:
        return rank_device(self.config, 0, self.size).type == "cuda"


def rank_device(config: Config, rank: int, size: int) -> torch.device:
    """cuda:rank on CUDA (one device per rank), else the CPU. Raises ModelLoadError when devices are missing."""
    name = config.device.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name != "cuda":
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if count < size:
        raise ModelLoadError(f"--tensor-parallel-size {size} needs {size} CUDA devices, but {count} are visible")
    return torch.device("cuda", rank)


def check_options(config: Config, size: int) -> None:
    """The options a sharded model does not take, refused with the reason."""
    if config.load.quantization == "gguf":
        raise ModelLoadError(
            f"--quantization gguf cannot be split over --tensor-parallel-size {size}: a GGUF block spans a row's"
            " inputs; use --quantization int8 or none"
        )
    if config.device.cpu_kernels == "native":
        raise ModelLoadError(
            f"--cpu-kernels native runs a whole unsharded layer per call; with --tensor-parallel-size {size}"
            " use --cpu-kernels auto or torch"
        )


def load_rank(config: Config, model_path: str, rank: int, size: int, group: DistGroup | None) -> LoadedModel:
    """This rank's share of the model, its row-parallel projections summed over ``group``."""
    loaded = load_model(
        model_path,
        dtype=config.model.dtype,
        device=str(rank_device(config, rank, size)),
        attention_backend=config.device.attention_backend,
        # The native decode path runs whole layers in C, with no all-reduce in between: torch under TP.
        cpu_kernels=config.device.cpu_kernels if size == 1 else "torch",
        load_format=config.load.load_format,
        quantization=config.load.quantization,
        tp_rank=rank,
        tp_size=size,
    )
    if group is not None:
        attach_all_reduce(loaded.model, group.all_reduce)
    return loaded


def plan_rank(
    config: Config, loaded: LoadedModel, max_len: int, kv_cache_memory: int, group: DistGroup | None
) -> MemoryFigures:
    """This rank's memory plan with the block count every rank can hold (a collective: all ranks call it)."""
    c = config
    figures = plan_memory(
        loaded,
        block_size=c.cache.block_size,
        max_len=max_len,
        kv_cache_memory=kv_cache_memory,
        gpu_memory_utilization=c.cache.gpu_memory_utilization,
        max_num_batched_tokens=c.scheduler.max_num_batched_tokens,
        max_num_seqs=c.scheduler.max_num_seqs,
        seed=c.model.seed,
    )
    if group is None:
        return figures
    num_blocks = group.min(figures.num_blocks)
    if num_blocks != figures.num_blocks:
        log.info("rank %d could hold %d blocks; the smallest rank holds %d", group.rank, figures.num_blocks, num_blocks)
    figures.num_blocks = num_blocks
    figures.kv_cache_bytes = num_blocks * loaded.block_bytes(c.cache.block_size)
    return figures


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


def pack_step(inputs: StepInputs) -> tuple:
    """The forward's inputs as host arrays (they pickle in microseconds, tensors in tens of them)."""
    m = inputs.meta
    arrays = (inputs.input_ids, inputs.positions, m.query_start_loc, m.seq_lens, m.block_tables, m.slot_mapping)
    return (*(t.cpu().numpy() for t in arrays), m.max_query_len, m.max_seq_len, m.query_lens_cpu, m.seq_lens_cpu)


def unpack_step(message: tuple, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    input_ids, positions, qsl, seq_lens, tables, slots, max_q, max_s, q_lens, s_lens = message
    t = [torch.from_numpy(a).to(device) for a in (input_ids, positions, qsl, seq_lens, tables, slots)]
    meta = AttentionMetadata(t[2], t[3], t[4], t[5], max_q, max_s, q_lens, s_lens)
    return t[0], t[1], meta


def follower_main(plan: RankPlan, rank: int, conn: multiprocessing.connection.Connection) -> None:
    """Ranks 1..N-1: load the shard, agree on the cache, then run each step rank 0 sends until it says stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C: rank 0 stops the ranks in order
    _die_with(plan.parent_pid)
    c = plan.config
    setup_logging(f"worker-rank{rank}", c.observability.log_level, c.observability.log_format)
    if c.device.num_threads > 0:
        torch.set_num_threads(c.device.num_threads)
    device = rank_device(c, rank, plan.size)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        group = DistGroup(rank, plan.size, plan.init_addr, device)
        loaded = load_rank(c, plan.model_path, rank, plan.size, group)
        max_len = max_model_len(loaded.args, loaded.hf_config, c.model.max_model_len)
        figures = plan_rank(c, loaded, max_len, plan.kv_cache_memory, group)
        runner = create_runner(loaded, c.cache.block_size, figures.num_blocks, c.model.seed)
        log.info("rank %d ready on %s: %d KV blocks", rank, device, figures.num_blocks)
        serve_steps(conn, runner)
    except (ModelLoadError, InsufficientMemory) as exc:
        log.error("rank %d: %s", rank, exc)
        sys.exit(1)
    except EOFError:
        log.error("rank %d: rank 0 is gone", rank)
        sys.exit(1)
    group.close()


@torch.inference_mode()
def serve_steps(conn: multiprocessing.connection.Connection, runner: ModelRunner) -> None:
    """Each message is one step's batch; ``None`` ends the loop. Raises EOFError when rank 0 is gone."""
    while (message := conn.recv()) is not None:
        input_ids, positions, meta = unpack_step(message, runner.device)
        runner.model(input_ids, positions, runner.kv_caches, meta)


def _die_with(parent_pid: int) -> None:
    """SIGKILL when rank 0 dies (Linux), even while blocked in a collective that would never return."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # rank 0 died before the line above
        os._exit(1)


def tensor_parallel_size(config: Config) -> int:
    return config.parallel.tensor_parallel_size if config.parallel is not None else 1


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
    plan = RankPlan(config, source.path, size, f"127.0.0.1:{free_port()}", share, os.getpid())
    return Ranks(plan), source.path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
