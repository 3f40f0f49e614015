"""``kvgrid worker-rank``: the ranks of one node (1..N-1) of a worker group whose rank 0 runs elsewhere.

Given only the rendezvous address (``--distributed-init-method tcp://HOST:PORT``, or MASTER_ADDR and
MASTER_PORT) and ``--node-rank K``, it reads the rank plan rank 0 published in its store and starts ranks
K*R..(K+1)*R-1 (R = world / --nnodes) as child processes, each one device. It exits with the first rank
that exits (stopping the others): 0 when rank 0 stopped the group, 1 when a rank or rank 0 was lost. Its
supervisor (``kvgrid serve``, Kubernetes) starts it again, and it waits for rank 0's store.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import sys

from services.common.config import Config
from services.common.default_model import resolve_model
from services.common.logs import setup_logging
from services.worker.parallel import rendezvous
from services.worker.parallel.follower import follower_main
from services.worker.parallel.plan import RankPlan, ranks_per_node
from services.worker.setup.gguf_cache import cached_source
from services.worker.setup.loader import resolve_source

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0


def main(config: Config) -> int:
    setup_logging("worker-rank", config.observability.log_level, config.observability.log_format)
    address = rendezvous.init_address(config)
    node = config.parallel.node_rank
    if address is None:
        print(
            "kvgrid worker-rank: give rank 0's --distributed-init-method tcp://HOST:PORT (or MASTER_ADDR)",
            file=sys.stderr,
        )
        return 2
    if node == 0:
        print("kvgrid worker-rank: --node-rank 0 is rank 0's node (kvgrid worker); give 1 or more", file=sys.stderr)
        return 2
    host, port = address
    log.info("node %d: waiting for rank 0's rendezvous at %s:%d", node, host, port)
    try:
        store = rendezvous.join_store(host, port, None)
        plan: RankPlan = rendezvous.read_plan(store)
    except (RuntimeError, OSError) as exc:  # torch's store raises RuntimeError (DistStoreError) on a timeout
        print(f"kvgrid worker-rank: no rendezvous at {host}:{port} ({str(exc).splitlines()[0]})", file=sys.stderr)
        return 1
    nnodes = plan.config.parallel.nnodes
    if node >= nnodes:
        print(f"kvgrid worker-rank: --node-rank {node}, but rank 0 runs a group of {nnodes} nodes", file=sys.stderr)
        return 2
    local = ranks_per_node(plan.config)
    # This node's own copy of the model: the path rank 0 resolved may not exist here.
    path = cached_source(resolve_source(resolve_model(plan.config.model.model), plan.config.load.load_format)).path
    plan = dataclasses.replace(plan, model_path=path, parent_pid=os.getpid())
    ctx = multiprocessing.get_context("spawn")
    procs = {}
    for rank in range(node * local, (node + 1) * local):
        procs[rank] = ctx.Process(target=follower_main, args=(plan, rank, host), name=f"kvgrid-rank{rank}")
        procs[rank].start()
    log.info("node %d of %d: rank pids %s", node, nnodes, ", ".join(f"{r} pid {p.pid}" for r, p in procs.items()))
    sentinels = {p.sentinel: rank for rank, p in procs.items()}
    first = sentinels[multiprocessing.connection.wait(list(sentinels))[0]]
    procs[first].join()
    code = procs[first].exitcode
    for proc in procs.values():
        proc.join(STOP_TIMEOUT_S if code == 0 else 0)
        if proc.is_alive():
            proc.kill()
            proc.join()
    if code != 0:
        log.error("node %d: rank %d (pid %d) exited with code %s; stopping this node's ranks", node, first,
                  procs[first].pid, code)  # fmt: skip
        return 1
    log.info("node %d: rank 0 stopped the group", node)
    return 0
