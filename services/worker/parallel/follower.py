"""Ranks 1..N-1 of a worker group, and the step message rank 0 sends them.

A follower joins rank 0's store, connects to the control channel, loads its stage's shard, agrees on the
block count, then runs the forward of each step rank 0 sends (meeting the other ranks at the all-reduces
and the stage hand-offs) until it reads ``None``. It never samples: rank 0 alone computes logits. It dies
with the process that started it (PR_SET_PDEATHSIG) and with rank 0 (the control channel's end of file),
and ignores Ctrl-C, which reaches the whole process group: rank 0 stops it in order.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable

import torch

from services.common.logs import setup_logging
from services.worker.attention.base import AttentionMetadata
from services.worker.model_runner import ModelRunner, StepInputs
from services.worker.parallel import rendezvous
from services.worker.parallel.control import ControlClient
from services.worker.parallel.group import DistGroup, RankLost
from services.worker.parallel.plan import RankPlan, layout_of, load_rank, plan_rank, rank_device
from services.worker.parallel.stages import BusyQuery, StagedModel, drop_unused_weights
from services.worker.setup.build import create_runner, max_model_len
from services.worker.setup.loader import ModelLoadError
from services.worker.setup.memory import InsufficientMemory

log = logging.getLogger(__name__)


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


def follower_main(plan: RankPlan, rank: int, host: str) -> None:
    """Ranks 1..N-1: join at ``host`` (rank 0's), load the shard, agree on the cache, then run each step rank 0
    sends until it says stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C: rank 0 stops the ranks in order
    _die_with(plan.parent_pid)
    c = plan.config
    setup_logging(f"worker-rank{rank}", c.observability.log_level, c.observability.log_format)
    if plan.num_threads > 0:
        torch.set_num_threads(plan.num_threads)
    group = None
    try:
        device = rank_device(c, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        store = rendezvous.join_store(host, plan.host_port[1], plan.size)
        control = ControlClient(host, rendezvous.control_port(store), rank)
        group = DistGroup(layout_of(c, rank), store, device)
        loaded = load_rank(c, plan.layers, plan.model_path, rank, group)
        max_len = max_model_len(loaded.args, loaded.hf_config, c.model.max_model_len)
        figures = plan_rank(c, loaded, max_len, plan.kv_cache_memory, group)
        runner = create_runner(loaded, c.cache.block_size, figures.num_blocks, c.model.seed)
        if plan.layers:
            freed = drop_unused_weights(loaded.model, layout_of(c, rank))
            log.info("rank %d: stage %d of layers %s; %.1f MiB of weights it never runs freed", rank,
                     layout_of(c, rank).stage, plan.layers[layout_of(c, rank).stage], freed / 2**20)  # fmt: skip
            runner.model = StagedModel(runner.model, group)
        log.info("rank %d ready on %s: %d KV blocks", rank, device, figures.num_blocks)
        serve_steps(control, runner, lambda key: store.set(f"{key}/{rank}", str(runner.model.busy_s)))
    except (ModelLoadError, InsufficientMemory) as exc:
        log.error("rank %d: %s", rank, exc)
        sys.exit(1)
    except (EOFError, RankLost, ConnectionError) as exc:
        log.error("rank %d: another rank is gone (%s); exiting", rank, exc)
        logging.shutdown()
        os._exit(1)  # gloo's teardown may wait for the dead peer
    # Nothing is left to flush but the logs; tearing down the process groups (or the interpreter's torch and
    # gloo state) took seconds here and can wait on peers, which rank 0 (and a SIGTERM's grace) would wait out.
    logging.shutdown()
    os._exit(0)


@torch.inference_mode()
def serve_steps(conn, runner: ModelRunner, report_busy: Callable[[str], None] | None = None) -> None:
    """Each message ``conn.recv()`` gives is one step's batch (or a BusyQuery for ``report_busy``); ``None`` ends
    the loop. Raises EOFError when rank 0 is gone."""
    while (message := conn.recv()) is not None:
        if isinstance(message, BusyQuery):
            if report_busy is not None:
                report_busy(message.key)
            continue
        input_ids, positions, meta = unpack_step(message, runner.device)
        runner.model(input_ids, positions, runner.kv_caches, meta)


def _die_with(parent_pid: int) -> None:
    """SIGKILL when rank 0 dies (Linux), even while blocked in a collective that would never return.

    The signal follows the *thread* that started this process: rank 0's model thread (or the caller's
    thread of ``build_core``), or the main thread of a node's ``kvgrid worker-rank``."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the line above
        os._exit(1)
